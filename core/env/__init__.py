"""The env workload of seeds 001 and 003: sampler actors stepping environments, a replay that
paces them against the learners, and the learners (docs/architecture.md)."""
