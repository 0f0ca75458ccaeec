"""Agent loops: multi-turn episodes whose model turns call tools (docs/agents.md)."""
