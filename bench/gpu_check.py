"""``python -m bench.gpu_check [--out DIR] [--steps N] [--keep-model]``: asyncrl's GPU path, proved or disproved
on one GPU in a few minutes (``make gpu-check``; docs/gpu.md).

It builds a random-weight model of Qwen2.5-0.5B's decoder shape locally (nothing from a hub),
runs scenarios/real-cpu-torch.yaml on it on the local runtime with the torch engine in bfloat16
and the trainer as ``learn.sharding: fsdp2``, ``learn.param_dtype: bfloat16``, every mode a few
trainer steps with a weight sync after each, and after every sync compares each engine's
parameters with the trainer's master weights cast to the engine's dtype, bit for bit. It prints
per mode the measured throughput, sync times, NVML utilization and memory and the trainer's
MFU, each beside the sim's prediction for the same setup, and writes it all to
``DIR/gpu_check.json``.

Exit codes: 0 every mode ran and every sync's weights were equal; 1 a mismatch or a failure;
2 no GPU here (one line, nothing built or written), or bad input (one line).

``--cpu-smoke`` (for tests, not in --help) runs the same code on CPU with the tiny model and two
steps per mode; ``--model DIR`` (not in --help) uses a model directory instead of building one.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import gc
import hashlib
import importlib
import importlib.util
import json
import logging
import os
import platform
import sys
import tempfile
import threading
import time
import traceback
import typing
import warnings
from datetime import datetime, timezone
from pathlib import Path

import harness

if __name__ == "__main__":
    harness.starting()  # until Check.run: Ctrl-C is one line, with nothing built yet

ROOT = Path(__file__).resolve().parent.parent
SCENARIO = ROOT / "scenarios" / "real-cpu-torch.yaml"
JSON_FILE = "gpu_check.json"
# The files the check writes beside its model (a given empty --out gets only these back out).
WRITTEN = (JSON_FILE, "sim-lengths.json", "stacks.txt")
OUT_KIND = "gpu-check"  # the stamp of an output directory the check made (core/model/owned.py)
SCHEMA = "asyncrl.gpu_check/1"
NO_GPU = "gpu_check: no GPU here ({why}); it runs on a GPU machine: see docs/gpu.md"
# Looked for before the project's modules are imported, so that a missing one is a line, not a
# traceback; the light ones are imported too (a wheel for another Python is found, not loaded).
# WHEELED: what `make gpu-wheels` brings; the rest the GPU machine must have.
NEEDED = ("numpy", "yaml", "rich", "pydantic", "tokenizers", "safetensors", "transformers")
LIGHT = ("numpy", "yaml", "rich", "pydantic", "tokenizers", "safetensors")
WHEELED = ("pydantic",)

# Qwen2.5-0.5B's config.json: 24 layers, 14 heads of 64 (hidden 896), 2 KV heads, MLP 4864, tied
# embeddings. The vocabulary is the letters task's: a random model over Qwen's 151,936 ids would
# almost never sample <eos> or a word the task scores, so every group would have equal rewards,
# no gradient, and the syncs would carry unchanged weights.
GPU_MODEL = {"layers": 24, "heads": 14, "kv_heads": 2, "head_dim": 64, "intermediate": 4864, "max_positions": 4096}
# Sized to end well inside 6 minutes on one H200 (an estimate: nothing has run there yet).
GPU_RUN = {"trainer.steps": 4, "trainer.batch_size": 64, "workload.max_response_len": 128, "rollout.max_num_seqs": 64}
SMOKE_RUN = {"trainer.steps": 2, "trainer.batch_size": 32, "workload.max_response_len": 48, "rollout.max_num_seqs": 32}
# The GPU path users train with: FSDP2, bf16 compute over float32 master weights.
LEARN = {"sharding": "fsdp2", "param_dtype": "bfloat16", "reduce_dtype": "float32"}

# The sim's GPU: NVIDIA H200 SXM datasheet (4.8 TB/s HBM3e, 989 dense BF16 TFLOP/s, 141 GB,
# NVLink 900 GB/s both directions). Every other cost term keeps the sim's default.
SIM_GPU = {"gpu.name": "H200-SXM", "gpu.hbm_gb_s": 4800.0, "gpu.bf16_tflops": 989.0, "gpu.memory_gb": 141.0, "gpu.nvlink_gb_s": 450.0}
# The defaults behind the sim's figures here: printed, so that nobody reads them as fitted.
SIM_ASSUMED = (
    "trainer.mfu", "trainer.step_overhead_s", "rollout.decode_overhead_s", "rollout.decode_mfu", "rollout.prefill_mfu",
    "gpu.hbm_efficiency", "sync.latency_s", "sync.bandwidth_gb_s", "sync.offload_gb_s",
)

MEASURED_KEYS = (
    "throughput/trained_samples_per_s", "throughput/trained_tokens_per_s", "throughput/generated_tokens_per_s",
    "sync/count", "sync/pause_mean_s", "sync/drain_mean_s", "sync/transfer_mean_s",
    "util/gpu", "util/gpu_source", "util/gpu_spans", "util/gpu0", "util/gpu0_memory_peak_gb", "util/gpu_samples",
    "util/mfu", "util/mfu_busy", "util/mfu_peak_tflops", "util/implied_trainer_mfu",
    "util/rollout_busy", "util/trainer_busy", "run/duration_s", "run/wall_s", "latency/step_mean_s",
    "samples/trained", "samples/lost", "staleness/mean", "staleness/max", "learn/reward_mean",
)
PREDICTED_KEYS = (
    "throughput/trained_samples_per_s", "throughput/trained_tokens_per_s", "sync/count", "sync/pause_mean_s",
    "sync/transfer_mean_s", "util/gpu", "util/gpu_source", "util/implied_trainer_mfu", "sim/duration_s",
)
# The check, its setup included, is meant to end inside 6 minutes; past this it reports what it
# has rather than hang on (make gpu-check's wheels and build come first: under half a minute, estimated).
DEADLINE_S = 300.0
MISMATCHES_KEPT = 5  # per engine and sync: enough to see a pattern, never the whole model


class BadInput(Exception):
    """One line, exit 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> typing.NoReturn:
        raise BadInput(f"{' '.join(message.split())}; fix: see python -m bench.gpu_check --help")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = _Parser(prog="python -m bench.gpu_check", description=__doc__.split("\n\n")[1],
                epilog="exit 0: every mode ran and every sync's weights were equal; 1: a mismatch or a failure; "
                       "2: no GPU here, or bad input. See docs/gpu.md.")
    p.add_argument("--out", type=Path, help="output directory, new or empty (default: a new temporary directory)")
    p.add_argument("--keep-model", action="store_true", help="keep the built model (DIR/model, about 1.4 GB of float32)")
    p.add_argument("--steps", type=_steps, help=f"trainer steps per mode (default {GPU_RUN['trainer.steps']}; one weight sync after each but the last)")
    p.add_argument("--deadline-s", type=_seconds, default=DEADLINE_S,
                   help=f"stop with what the check has, every thread's stack and exit 1 after this long (default {DEADLINE_S:g}; 0: never)")
    p.add_argument("--cpu-smoke", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _steps(text: str) -> int:
    if not text.strip().isdigit() or not 2 <= int(text) <= 1000:
        raise argparse.ArgumentTypeError(f"{text[:20]!r} is not a whole number from 2 to 1000 (two steps make the first sync)")
    return int(text)


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value <= 86400:
        raise argparse.ArgumentTypeError(f"{text[:20]!r} is not a number of seconds from 0 to 86400")
    return value


def no_gpu_reason() -> str | None:
    """Why the GPU path cannot run here, or None. Imports torch, nothing of the project."""
    if importlib.util.find_spec("torch") is None:
        return "torch is not installed"
    # A CUDA build of torch without a driver warns on stderr: the one line has to stay one.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import torch

        if not torch.cuda.is_available():
            return "torch sees no CUDA device"
    return None


def out_dir(given: Path | None) -> tuple[Path, bool]:
    """The output directory, made now: ``given`` if it is new or an empty directory; and
    whether it was made here."""
    from core.model.owned import make_owned, stamp

    if given is None:
        return make_owned(Path(tempfile.gettempdir()), "asyncrl-gpu-check-", OUT_KIND), True
    if given.is_symlink() or (given.exists() and not given.is_dir()):
        raise BadInput(f"--out {given}: exists and is not a directory; fix: name a new or empty directory")
    if given.is_dir():
        if any(given.iterdir()):
            raise BadInput(f"--out {given}: is not empty; fix: name a new or empty directory")
        return given, False
    try:
        given.mkdir(parents=True)
    except OSError as exc:
        raise BadInput(f"--out {given}: cannot be made ({exc.strerror}); fix: name a directory you can write") from None
    stamp(given, OUT_KIND)
    return given, True


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv)
        if not args.cpu_smoke:
            why = no_gpu_reason()
            if why is not None:
                print(NO_GPU.format(why=why), file=sys.stderr)
                return 2
        if args.model is not None and not (args.model / "config.json").is_file():
            raise BadInput(f"--model {args.model}: no config.json there; fix: name a Hugging Face model directory")
        missing = [m for m in NEEDED if importlib.util.find_spec(m) is None]
        if any(m in WHEELED for m in missing):
            raise BadInput(f"{', '.join(missing)}: not installed; fix: run make gpu-wheels where a package index is reachable, "
                           "bring .whl/ here and run make gpu-check (docs/gpu.md)")
        if missing:
            raise BadInput(f"{', '.join(missing)}: not installed; fix: pip install -e '.[real]' (torch, transformers, tokenizers, "
                           "safetensors), or run where they are (docs/gpu.md)")
        for m in LIGHT:
            try:
                importlib.import_module(m)
            except Exception as exc:
                raise BadInput(f"{m}: cannot be imported ({type(exc).__name__}: {' '.join(str(exc).split())[:200]}); fix: "
                               "make gpu-wheels for this machine's Python and run make gpu-check again (docs/gpu.md)") from None
        out, made = out_dir(args.out)
    except BadInput as exc:
        print(f"gpu_check: {exc}", file=sys.stderr)
        return 2
    return Check(args, out, made).run()


# ---- the check, once a GPU (or --cpu-smoke) and every package are there ------------------------
# The project's modules are imported here, not at the top: the no-GPU line and a missing
# package's line come first, and must not wait for, or fail in, torch or pydantic imports.


def _as_ints(t):
    """``t``'s raw bits, flat, as integers of its element size."""
    import torch

    ints = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.detach().contiguous().view(-1).view(ints)


def _digests(tensors: dict) -> dict[str, tuple[int, int]]:
    """Per tensor, two sums over its raw bits read as integers, modulo 2**64: plain, and weighted
    by position (a changed element always moves the first; swapped ones move the second)."""
    import torch

    names = sorted(tensors)
    sums = []
    for n in names:
        x = _as_ints(tensors[n]).to(torch.int64)
        w = torch.arange(x.numel(), device=x.device, dtype=torch.int64) % 65521 + 1
        sums.append(torch.stack([x.sum(), (x * w).sum()]))
    flat = torch.stack(sums).cpu().tolist() if sums else []
    return {n: (int(a), int(b)) for n, (a, b) in zip(names, flat)}


def _model_digest(d: dict[str, tuple[int, int]]) -> str:
    h = hashlib.sha256()
    for n in sorted(d):
        h.update(f"{n}:{d[n][0]}:{d[n][1]};".encode())
    return h.hexdigest()[:16]


def _bit_equal(a, b) -> bool:
    """The same dtype, shape and bits (so -0.0 is not 0.0, and a NaN equals the same NaN)."""
    import torch

    return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(_as_ints(a), _as_ints(b)))


class SyncWatch:
    """What the check hooks into the local runtime: the workers it builds (by wrapping
    ``core.runtimes.local.local_workers``, which core offers no hook for) and each sync's
    ``WeightsSynced``, after which the engines' weights are compared with the trainer's."""

    def __init__(self) -> None:
        self.workers = None
        self.syncs: list[dict] = []
        self.failures: list[str] = []
        self.check_s = 0.0
        self._last: str | None = None  # the trainer's digest at the previous sync (or at the start)
        self.trainer: dict = {}  # how the trainer holds its weights: what fsdp2 and bfloat16 came to

    @contextlib.contextmanager
    def installed(self):
        import core.runtimes.local as local

        original = local.local_workers

        def capture(plan, timeline, run_dir=None):
            workers = original(plan, timeline, run_dir)
            self.workers = workers
            try:  # before the run's clock starts: not counted in its time; never raised into the run
                be = workers.backend
                p = next(iter(be.parameters().values()))
                self.trainer = {"sharded": getattr(be, "sharded", None), "parameter_type": type(p).__name__,
                                "master_dtype": str(p.dtype).removeprefix("torch."), "device": str(p.device),
                                "engines": len(workers.engines), "engine_dtype": workers.engines[0].dtype}
                self._last = _model_digest(_digests(self._trainer_view()))
            except Exception as exc:
                self.failures.append(f"reading the trainer's weights at the start: {type(exc).__name__}: {exc}")
            return workers

        local.local_workers = capture
        try:
            yield self
        finally:
            local.local_workers = original
            self.workers = None

    def _trainer_view(self) -> dict:
        """The trainer's master weights, whole (FSDP2 shards gathered one tensor at a time),
        cast to the engines' dtype as a sync casts them, under the trainer's lock."""
        return self.workers.backend.weights_as(self.workers.engines[0].dtype)

    def on_step(self, event) -> None:
        from core.model.progress import WeightsSynced

        if not isinstance(event, WeightsSynced):
            return
        t0 = time.perf_counter()
        try:
            self.syncs.append(self._compare(event))
        except Exception as exc:  # never into the run: recorded, and the check fails
            self.failures.append(f"sync to version {event.version}: comparing weights failed: {type(exc).__name__}: {exc}")
            self.syncs.append({"version": event.version, "equal": False, "error": f"{type(exc).__name__}: {exc}"})
        self.check_s += time.perf_counter() - t0

    def _compare(self, event) -> dict:
        """Every engine against the trainer, bit for bit, just after the sync: the trainer waits
        for the sync to end before its next step, and the engines load weights only in a sync."""
        trainer = self._trainer_view()
        t_digest = _digests(trainer)
        digest = _model_digest(t_digest)
        engines = []
        for e in self.workers.engines:
            params = dict(e.model.named_parameters())
            wrong, diffs = [], {}
            names = sorted(params.keys() | trainer.keys())
            for n in names:
                if n not in params or n not in trainer:
                    wrong.append(n)
                    continue
                mine = params[n]
                theirs = trainer[n].to(mine.device)
                if not _bit_equal(mine, theirs):
                    wrong.append(n)
                    if len(diffs) < MISMATCHES_KEPT and mine.shape == theirs.shape:
                        diffs[n] = float((mine.float() - theirs.float()).abs().max())
            e_digest = _digests(params)
            engines.append({
                "engine": e.name, "dtype": str(next(iter(params.values())).dtype).removeprefix("torch."),
                "digest": _model_digest(e_digest), "tensors": len(params), "mismatched": len(wrong),
                "mismatched_names": wrong[:MISMATCHES_KEPT], "max_abs_diff": diffs,
            })
        changed = digest != self._last
        self._last = digest
        equal = bool(engines) and all(x["mismatched"] == 0 and x["digest"] == digest for x in engines)
        return {"version": event.version, "at_s": event.at_s, "equal": equal, "trainer_digest": digest,
                "tensors": len(trainer), "changed_since_previous": changed, "engines": engines}


class Check:
    def __init__(self, args: argparse.Namespace, out: Path, made_out: bool) -> None:
        self.args = args
        self.out = out
        self.made_out = made_out  # removed again if the input turns out bad
        self.smoke = bool(args.cpu_smoke)
        self.failures: list[str] = []
        self.record: dict = {}
        self.model_dir: Path | None = None
        self._t0 = time.perf_counter()
        self._done = threading.Lock()  # taken by the run's end or the deadline's, whichever comes first

    # ---- the run ------------------------------------------------------------------------

    def run(self) -> int:
        from rich.console import Console
        from rich.logging import RichHandler

        from core.real.workers import apply_env

        apply_env()  # before transformers is imported
        self.console = Console() if sys.stdout.isatty() else Console(width=160)
        err = Console(stderr=True)
        logging.basicConfig(level=logging.WARNING, handlers=[RichHandler(console=err, show_path=False)], format="%(message)s")
        self.record = record = {"schema": SCHEMA, "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                                "smoke": self.smoke, "command": ["python", "-m", "bench.gpu_check", *sys.argv[1:]]}
        harness.started()
        watchdog = None
        if self.args.deadline_s:
            watchdog = threading.Timer(self.args.deadline_s, self._deadline)
            watchdog.daemon = True
            watchdog.start()
        try:
            record["device"] = self._device()
            record["environment"] = self._environment()
            self.model_dir, record["model"] = self._model()
            sc, record["learn"] = self._scenario(self.model_dir)
            record["scenario"] = sc.model_dump(mode="json")
            record["nvml"] = self._nvml_note()
            self._header(record)
            record["modes"] = {}
            lengths = self._run_modes(sc, record["modes"])
            record["sim"] = self._predict(sc, record["modes"], lengths)
            self._table(record)
        except BadInput as exc:
            if watchdog is not None:
                watchdog.cancel()
            return self._refuse(str(exc))
        except KeyboardInterrupt:
            if watchdog is not None:
                watchdog.cancel()
            return self._discard("interrupted; nothing was kept", 130)
        except Exception as exc:
            self.failures.append(f"{type(exc).__name__}: {exc}")
            record["error"] = traceback.format_exc(limit=20)
            self.console.print(f"[bold red]gpu_check failed:[/] {type(exc).__name__}: {exc}", highlight=False, soft_wrap=True)
        if watchdog is not None:
            watchdog.cancel()
        return self._finish()

    def _refuse(self, line: str) -> int:
        """Bad input found once the check had begun: one line, exit 2, and nothing left written."""
        return self._discard(line, 2)

    def _discard(self, line: str, code: int) -> int:
        """Everything the check wrote removed, one line, and exit ``code``."""
        from core.model.owned import discard_owned

        self._remove_model()
        if self.made_out:
            discard_owned(self.out, OUT_KIND)
        else:  # an empty directory given: what the check wrote into it goes, nothing else
            for name in WRITTEN:
                (self.out / name).unlink(missing_ok=True)
        print(f"gpu_check: {line}", file=sys.stderr)
        return code

    def _deadline(self) -> None:
        """The run took longer than --deadline-s: what it has so far, every thread's stack, exit 1,
        rather than a hung collective holding the machine until whoever lent it takes it back."""
        if not self._done.acquire(blocking=False):
            return  # the run is writing its own end
        stacks = self.out / "stacks.txt"
        with open(stacks, "w") as f:
            faulthandler.dump_traceback(file=f, all_threads=True)
        self.failures.append(f"the run passed --deadline-s {self.args.deadline_s:g} s; every thread's stack is in {stacks.name}")
        self._write()
        os._exit(1)

    def _remove_model(self) -> bool:
        """The model the check built (stamped by core/real/tiny_model.py), never a given one."""
        from core.model.owned import discard_owned
        from core.model.config import TINY_MODEL_KIND

        if self.model_dir is None or self.args.model is not None:
            return False
        discard_owned(self.model_dir, TINY_MODEL_KIND)
        return not self.model_dir.exists()

    def _finish(self) -> int:
        self._done.acquire()  # held for good by a deadline that came first: it ends the process
        return self._write()

    def _write(self) -> int:
        record = self.record
        record["failures"] = self.failures
        record["passed"] = not self.failures
        record["wall_s"] = round(time.perf_counter() - self._t0, 1)
        if not self.args.keep_model and self._remove_model():
            record.get("model", {})["removed"] = True
        path = self.out / JSON_FILE
        path.write_text(json.dumps(record, indent=1, default=str) + "\n")
        verdict = "[bold green]PASS[/]" if record["passed"] else "[bold red]FAIL[/]"
        self.console.print(f"gpu_check: {verdict}" + ("" if record["passed"] else f": {'; '.join(self.failures[:3])}"),
                           highlight=False, soft_wrap=True)
        self.console.print(f"written: {path}", highlight=False, soft_wrap=True)
        return 0 if record["passed"] else 1

    def _device(self) -> dict:
        import torch

        if self.smoke:
            return {"kind": "cpu", "name": platform.processor() or platform.machine(), "torch": torch.__version__, "cuda": None}
        props = torch.cuda.get_device_properties(0)
        return {"kind": "cuda", "name": torch.cuda.get_device_name(0), "torch": torch.__version__, "cuda": torch.version.cuda,
                "capability": f"{props.major}.{props.minor}", "memory_gb": round(props.total_memory / 1e9, 1),
                "count": torch.cuda.device_count()}

    def _environment(self) -> dict:
        from harness import report

        return report.environment()  # machine, packages, ext backends, git commit (None outside a checkout)

    def _model(self) -> tuple[Path, dict]:
        """The model directory: given (--model), the tiny model (--cpu-smoke), else Qwen2.5-0.5B's
        shape, random weights and the letters task's tokenizer, built by core/real/tiny_model.py."""
        from core.model.config import TinyModelSpec
        from core.model.model_dir import ModelDirError, read_model_dir
        from core.real.tiny_model import build

        if self.args.model is not None:
            where, built, shape = self.args.model.resolve(), False, None
        else:
            shape = {} if self.smoke else GPU_MODEL
            where = self.out / "model"
            t0 = time.perf_counter()
            build(where, TinyModelSpec(path=str(where), **shape))
            built = round(time.perf_counter() - t0, 1)
        try:
            figures = read_model_dir(str(where))
        except ModelDirError as exc:
            raise BadInput(f"--model {where}: {exc}") from None
        info = {"dir": str(where), "built_s": built, "shape": shape or "tiny_model defaults",
                "params": figures.params if figures.params is not None else figures.params_estimate,
                "vocab": figures.vocab, "layers": figures.layers, "hidden": figures.hidden}
        return where, info

    def _scenario(self, model_dir: Path):
        from pydantic import ValidationError

        from core.model.config import ConfigError, with_changes
        from harness.scenario import ScenarioError, load

        learn = {"set": dict(LEARN)}
        changes = {
            "name": "gpu-check-smoke" if self.smoke else "gpu-check",
            "model.path": str(model_dir),
            "engine.dtype": "bfloat16",
            "trainer.sync_every": 1,
            "resources.rollout_gpus": 1,  # on one GPU both roles share the device (core/real/workers.py device())
            "resources.trainer_gpus": 1,
            "eval.every": 0,  # evaluation measures learning, which four steps of a random model do not show
            **(SMOKE_RUN if self.smoke else GPU_RUN),
            **{f"learn.{k}": v for k, v in LEARN.items()},
        }
        if self.args.steps is not None:
            changes["trainer.steps"] = self.args.steps
        try:
            sc = with_changes(load(SCENARIO), changes)
        except (ScenarioError, ConfigError) as exc:
            raise BadInput(str(exc)) from None
        except ValidationError as exc:
            raise BadInput(_validation_line(exc)) from None
        return sc, learn

    def _nvml_note(self) -> dict:
        if self.smoke:
            return {"available": False, "why": "--cpu-smoke: no GPU"}
        if importlib.util.find_spec("pynvml") is None:
            return {"available": False, "why": "pynvml is not installed (package nvidia-ml-py): no utilization or memory measured"}
        return {"available": True, "why": None}

    def _header(self, record: dict) -> None:
        d, m, learn = record["device"], record["model"], record["learn"]
        c = self.console
        env = record["environment"]
        commit = (env["git"].get("commit") or "unknown")[:12] + ("+dirty" if env["git"].get("dirty") else "")
        ext = "compiled" if set(env["backend"].values()) == {"ext"} else f"pure-Python references ({env['backend']})"
        c.print(f"gpu_check on {d['name']} ({d['kind']}, torch {d['torch']}, CUDA {d.get('cuda')}); commit {commit}; hot paths {ext}",
                highlight=False, soft_wrap=True)
        params = f"{m['params'] / 1e6:.0f} M parameters" if m.get("params") else "parameters unknown"
        c.print(f"model: {m['dir']} ({m['layers']} layers, hidden {m['hidden']}, vocabulary {m['vocab']}, {params}"
                + (f", built in {m['built_s']} s)" if m["built_s"] else ")"), highlight=False, soft_wrap=True)
        sets = ", ".join(f"learn.{k}: {v}" for k, v in learn["set"].items()) or "none"
        c.print(f"trainer: {sets}", highlight=False, soft_wrap=True)
        if not record["nvml"]["available"]:
            c.print(f"[yellow]NVML: {record['nvml']['why']}[/]", highlight=False, soft_wrap=True)

    def _run_modes(self, sc, modes: dict) -> dict:
        """Each mode in turn, its row put in ``modes`` as it ends (what a deadline reports); the
        lengths the runs trained, for the sim."""
        from core.runtimes.dispatch import run_mode
        from harness.console import ModeProgress
        from harness.gpu_sampler import NvmlSampler
        from harness.metrics import collect

        lengths = {"response": [], "prompt": []}
        for mode in sc.modes:
            watch = SyncWatch()
            row: dict = {"running": True, "failures": [], "syncs": watch.syncs}  # live: a deadline reports it as it is
            modes[mode] = row
            self._reset_peak()
            t0 = time.perf_counter()
            try:
                with watch.installed(), NvmlSampler() as gpu, ModeProgress(self.console, sc.trainer.steps) as progress:
                    progress.start(mode)

                    def told(event) -> None:
                        progress.on_step(event)
                        watch.on_step(event)

                    result = run_mode(sc, mode, on_step=told)
                metrics = collect(result, None, gpu.summary())
                row["measured"] = {k: metrics.get(k) for k in MEASURED_KEYS}
                be = result.trainer
                # The sim's MFU is over its GPU's BF16 peak: the trainer's figure on the same footing.
                row["measured"]["mfu_of_bf16_peak"] = (be.flops / (be.compute_s * SIM_GPU["gpu.bf16_tflops"] * 1e12)
                                                       if be.compute_s else None)
                row["measured"]["torch_peak_memory_gb"] = self._peak_memory()
                row["metrics"] = metrics
                for info in result.trainer.step_info:
                    lengths["response"] += [int(x) for x in info.get("response_lens", [])]
                    lengths["prompt"] += [int(x) for x in info.get("prompt_lens", [])]
                del result
            except Exception as exc:
                row["failures"].append(f"{mode}: the run failed: {type(exc).__name__}: {exc}")
                row["error"] = traceback.format_exc(limit=20)
            del row["running"]
            row["wall_s"] = round(time.perf_counter() - t0, 1)
            row["check_s"] = round(watch.check_s, 3)
            row["trainer"] = watch.trainer
            row["failures"] += [f"{mode}: {f}" for f in watch.failures]
            row["failures"] += self._judge(mode, row)
            self.failures += row["failures"]
            self._mode_line(mode, row)
            self._free()
        return lengths

    def _judge(self, mode: str, row: dict) -> list[str]:
        """What makes a mode fail besides an exception: a mismatch, a sync not compared, weights
        that never changed (then equality proves nothing), a sample lost."""
        if "measured" not in row:
            return []
        out = []
        syncs = row["syncs"]
        expected = int(row["measured"]["sync/count"] or 0)
        wrong = [s for s in syncs if not s.get("equal")]
        if wrong:
            out.append(f"{mode}: engine weights differ from the trainer's after {len(wrong)} of {len(syncs)} syncs "
                       f"(first: version {wrong[0]['version']})")
        if len(syncs) != expected:
            out.append(f"{mode}: {len(syncs)} syncs compared of {expected} the run made")
        if expected == 0:
            out.append(f"{mode}: the run made no weight sync, so nothing was compared")
        elif syncs and not any(s.get("changed_since_previous") for s in syncs):
            out.append(f"{mode}: no sync carried changed weights (no step had a gradient), so equality proves nothing")
        if row["measured"].get("samples/lost"):
            out.append(f"{mode}: {row['measured']['samples/lost']} samples lost")
        return out

    def _mode_line(self, mode: str, row: dict) -> None:
        syncs = row["syncs"]
        ok = sum(1 for s in syncs if s.get("equal"))
        status = "[green]ok[/]" if not row["failures"] else "[red]FAILED[/]"
        tr = row.get("trainer") or {}
        held = (f" ({tr['engines']} engine(s) in {tr['engine_dtype']}; trainer {tr['parameter_type']} {tr['master_dtype']} on {tr['device']}"
                f"{', sharded' if tr.get('sharded') else ''})") if tr else ""
        self.console.print(f"{mode}: {status}, weights equal after {ok} of {len(syncs)} syncs{held}, {row['wall_s']} s "
                           f"(comparing weights {row['check_s']} s of it)", highlight=False, soft_wrap=True)
        for f in row["failures"]:
            self.console.print(f"  [red]{f}[/]", highlight=False, soft_wrap=True)

    def _reset_peak(self) -> None:
        import torch

        if not self.smoke:
            torch.cuda.reset_peak_memory_stats()

    def _peak_memory(self) -> float | None:
        import torch

        return None if self.smoke else round(torch.cuda.max_memory_allocated() / 1e9, 2)

    def _free(self) -> None:
        import torch

        gc.collect()
        if not self.smoke:
            torch.cuda.empty_cache()

    # ---- the sim's prediction -----------------------------------------------------------

    def _predict(self, sc, modes: dict, lengths: dict) -> dict:
        """The sim on the same scenario, with H200's datasheet figures and the response and
        prompt lengths this run generated; every other cost term at the sim's default."""
        from core.model.config import with_changes
        from core.runtimes.dispatch import run_mode
        from harness.metrics import collect

        if not lengths["response"]:
            return {"error": "no mode trained anything: nothing to predict for"}
        lengths_file = self.out / "sim-lengths.json"
        lengths_file.write_text(json.dumps(lengths["response"]))
        prompt = max(1, round(sum(lengths["prompt"]) / len(lengths["prompt"])))
        changes = {
            "runtime": "sim", "engine.kind": "sim", **SIM_GPU,
            "model.dtype_bytes": 2,  # the engines' bfloat16 (the directory says float32)
            "workload.lengths": str(lengths_file), "workload.prompt_tokens": prompt,
        }
        try:
            sim = with_changes(sc, changes)
        except Exception as exc:
            self.failures.append(f"the sim's scenario: {type(exc).__name__}: {' '.join(str(exc).split())[:300]}")
            return {"error": self.failures[-1]}
        assumed = {}
        for key in SIM_ASSUMED:
            part, field = key.split(".")
            assumed[key] = getattr(getattr(sim, part), field)
        note = ("the sim's figures come from its cost model, not fitted to this machine: gpu.* from the H200 SXM datasheet, "
                "the lengths measured in this run, every other term its default (assumed); it gives each role its own GPUs "
                f"({sc.resources.rollout_gpus} rollout + {sc.resources.trainer_gpus} trainer), where this run shares one device")
        device = self.record["device"]
        if device["kind"] == "cuda" and "H200" not in device["name"]:
            note += f"; this device is {device['name']}, not an H200, yet the sim and the MFU column use H200's figures"
        out = {"set": {k: v for k, v in changes.items() if k != "workload.lengths"} | {"workload.lengths": "sim-lengths.json"},
               "assumed": assumed, "note": note}
        for mode, row in modes.items():
            try:
                m = collect(run_mode(sim, mode))
                row["predicted"] = {k: m.get(k) for k in PREDICTED_KEYS}
            except Exception as exc:
                row["predicted"] = {"error": f"{type(exc).__name__}: {exc}"}
                self.failures.append(f"{mode}: the sim's prediction failed: {type(exc).__name__}: {exc}")
        return out

    # ---- the table ----------------------------------------------------------------------

    def _table(self, record: dict) -> None:
        from rich import box
        from rich.table import Table

        nvml = record["nvml"]["available"]
        t = Table(title=f"{record['scenario']['name']}: measured, and the sim's prediction for the same setup", title_justify="left",
                  box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True, caption_justify="left",
                  caption=("samples/s, tokens/s: trained, prompt + response. pause, transfer: mean seconds per weight sync. "
                           "GPU: NVML utilization (sim: modeled busy share) and peak memory in GB. "
                           f"MFU: trainer model FLOPs over busy time at {SIM_GPU['gpu.bf16_tflops']:.0f} TFLOP/s BF16 "
                           "(harness util/mfu: below). "
                           "weights: syncs whose engine weights equal the trainer's, bit for bit."))
        for title in ("mode", "", "samples/s", "tokens/s", "pause s", "transfer s", "GPU util", "GPU GB", "MFU", "weights"):
            t.add_column(title, justify="left" if title in ("mode", "") else "right", no_wrap=True)
        for mode, row in record["modes"].items():
            m, p = row.get("measured"), row.get("predicted") or {}
            syncs = row["syncs"]
            weights = f"{sum(1 for s in syncs if s.get('equal'))}/{len(syncs)}"
            if m is None:
                t.add_row(mode, "measured", *(["failed"] + [""] * 6), weights)
            else:
                util = _pct(m.get("util/gpu")) if nvml and m.get("util/gpu_source") == "nvml" else "n/a"
                mem = _num(m.get("util/gpu0_memory_peak_gb")) if nvml else "n/a"
                t.add_row(mode, "measured", _num(m["throughput/trained_samples_per_s"]), _num(m["throughput/trained_tokens_per_s"]),
                          _num(m["sync/pause_mean_s"]), _num(m["sync/transfer_mean_s"]), util, mem,
                          _pct(m.get("mfu_of_bf16_peak")), weights)
            if "error" in p:
                t.add_row("", "sim", f"failed: {p['error']}", *[""] * 7)
            elif p:
                t.add_row("", "[dim]sim[/]", *(f"[dim]{x}[/]" for x in (
                    _num(p["throughput/trained_samples_per_s"]), _num(p["throughput/trained_tokens_per_s"]),
                    _num(p["sync/pause_mean_s"]), _num(p["sync/transfer_mean_s"]), _pct(p.get("util/gpu")), "-",
                    _pct(p.get("util/implied_trainer_mfu")), "-")))
        self.console.print(t)
        ran = {mode: row["measured"] for mode, row in record["modes"].items() if row.get("measured")}
        if ran:
            peak = max((m.get("util/mfu_peak_tflops") or 0.0) for m in ran.values())
            self.console.print(f"harness util/mfu (over the {peak:.3g} TFLOP/s its GEMM probe measured): "
                               + ", ".join(f"{mode} {_pct(m.get('util/mfu'))}" for mode, m in ran.items())
                               + ("; torch peak allocated GB: " + ", ".join(f"{mode} {_num(m.get('torch_peak_memory_gb'))}" for mode, m in ran.items())
                                  if not self.smoke else ""), highlight=False, soft_wrap=True)
        sim = record["sim"]
        if "error" in sim:
            self.console.print(f"[red]sim: {sim['error']}[/]", highlight=False, soft_wrap=True)
        if "note" in sim:
            self.console.print(f"[yellow]{sim['note']}.[/]", highlight=False, soft_wrap=True)
            self.console.print("sim set: " + ", ".join(f"{k}={v}" for k, v in sim["set"].items()), highlight=False, soft_wrap=True)
            self.console.print("sim assumed (defaults): " + ", ".join(f"{k}={v}" for k, v in sim["assumed"].items()),
                               highlight=False, soft_wrap=True)


def _num(v) -> str:
    if v is None:
        return "-"
    v = float(v)
    if abs(v) >= 1000:
        return f"{v / 1000:.1f}k"
    return f"{v:.3g}" if abs(v) < 10 else f"{v:.1f}"


def _pct(v) -> str:
    if v is None:
        return "-"
    v = 100 * float(v)
    return f"{v:.2g}%" if 0 < abs(v) < 1 else f"{v:.1f}%"


def _validation_line(exc) -> str:
    """A pydantic ValidationError as the one line its ConfigError would have been."""
    err = exc.errors()[0]
    cause = err.get("ctx", {}).get("error")
    if cause is not None:
        return " ".join(str(cause).split())
    return f"{'.'.join(str(p) for p in err['loc']) or 'scenario'}: {' '.join(str(err['msg']).split())}"


if __name__ == "__main__":
    sys.exit(main())
