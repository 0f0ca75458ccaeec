"""Each mode's figures while it runs: ``<mode>/metrics.jsonl``, a line per event appended and
flushed as it happens, and the same figures to every logger the scenario lists
(``report.loggers``: TensorBoard, W&B, MLflow).

A line is one JSON object; ``time_s`` is the run's clock (simulated seconds on the sim, else
seconds since the mode started), ``unix_s`` when the line was written. Its ``event``:

- ``step`` (a trainer step): ``step``, ``version`` (of the weights it trained), the run's totals
  so far as report.json names them (``samples/trainings``, ``samples/trained``, ``tokens/trained``,
  ``staleness/mean``, ``staleness/max``), the step's own ``step/samples`` and
  ``step/staleness_mean``, and every figure the trainer reported of it as ``train/<name>``
  (``train/tokens``; a real run's ``train/loss``, ``train/reward_mean``, ...).
- ``sync`` (rollout took new weights): ``version``, ``sync/pause_s``, ``sync/drain_s``, ``sync/transfer_s``.
- ``publish`` (an env learner's new version): ``version``, ``env/steps``, ``learner/updates``, and
  its batch's figures as ``learner/<name>`` where it keeps any (PPO).
- ``eval`` (an env policy evaluated): ``version``, ``env/steps``, ``eval/return``.

The loggers plot steps against ``step``, syncs against ``version``, an env run against ``env/steps``.
A resumed mode cuts metrics.jsonl back to what happened before its checkpoint, and gives the
loggers that history again (TensorBoard's event files are written anew; W&B and MLflow get a new run).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import io
import json
import math
import numbers
import os
import socket
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Optional, Protocol

from core.model.bounded_parse import TooNested, loads_json
from core.model.progress import PolicyEvaluated, Progress, StepTrained, VersionPublished, WeightsSynced
from core.model.regular_file import UnreadableFile, read_regular
from core.store.checkpoint import write_atomic
from harness import first_line
from harness.extras import installed
from harness.scenario import ScenarioError

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_FILES = "events.out.tfevents.*"
# The module each logger imports, and how to install it.
PACKAGES = {
    "tensorboard": ("tensorboardX", "pip install tensorboardX"),
    "wandb": ("wandb", "pip install wandb"),
    "mlflow": ("mlflow", "pip install mlflow-skinny"),
}
# Each kind of line's x-axis in the loggers.
AXIS = {"step": "step", "sync": "version", "publish": "env/steps", "eval": "env/steps"}
TENSORBOARD_FLUSH_S = 2  # TensorBoard's own reload period is 30 s: this is live enough
TENSORBOARD_QUEUE = 100  # events the writer's thread may lag behind before a step waits for it
MAX_FILE_BYTES = 1 << 30  # metrics.jsonl read back on resume: a line per step, never near this
# How every line asyncrl writes begins (as_line puts the event first): what a line a kill cut
# short at the end of the file must start with to be taken for one.
_LINE_HEAD = b'{"event": "'


# How long a network logger may take to answer before the run gives up on it (seconds), and
# how often MLflow tries again: its defaults (120 s, 7 retries with back-off) kept a run with an
# unreachable tracking server waiting for many minutes before its first step.
CONNECT_TIMEOUT_S = 30
MLFLOW_RETRIES = 1


class LoggerFailed(RuntimeError):
    """A live logger (report.loggers) could not start: one line naming it, what failed and the fix."""


class MetricsFileError(ValueError):
    """A metrics.jsonl a resume cannot go on from: the file, the line, what and the fix."""


def check_loggers(loggers: tuple[str, ...]) -> None:
    """Every logger listed can start, as far as can be told before anything runs: its package
    imports, W&B has a login where it runs online, MLflow's tracking server (an http(s)
    ``MLFLOW_TRACKING_URI``) takes a connection. Else one line naming the logger and the fix."""
    for name in loggers:
        module, install = PACKAGES[name]
        if not installed(module):
            raise ScenarioError(f"report.loggers = {list(loggers)}: {name} is not installed; fix: {install}, "
                                f"or drop {name} from report.loggers")
        try:
            with _quiet():
                importlib.import_module(module)
        except Exception as exc:  # a broken install fails as anything (a protobuf or numpy mismatch)
            raise ScenarioError(f"report.loggers: {name} is installed but fails as it is imported ({first_line(exc)}); "
                                f"fix: {install} --force-reinstall, or drop {name} from report.loggers") from None
        if name == "wandb":
            _check_wandb_login()
        elif name == "mlflow":
            _check_mlflow_server()


@contextlib.contextmanager
def _quiet():
    """What a logger's package prints as it is imported or checked (W&B's banners): not the harness's terminal."""
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        yield


_WANDB_LOCAL = ("offline", "dryrun", "disabled")  # W&B's modes that never contact a server
_WANDB_MODES = ("online", "run", "shared", *_WANDB_LOCAL)


def _check_wandb_login() -> None:
    mode = os.environ.get("WANDB_MODE", "online")
    if mode in _WANDB_LOCAL:
        return
    if mode not in _WANDB_MODES:
        raise ScenarioError(f"report.loggers: WANDB_MODE = {mode[:40]!r} is not a mode W&B has ({', '.join(_WANDB_MODES)}); "
                            "fix: export WANDB_MODE=offline, or unset it to run online")
    wandb = importlib.import_module("wandb")
    try:
        with _quiet():
            ok = wandb.login(verify=False, timeout=CONNECT_TIMEOUT_S)  # reads the key (env, netrc); no network
    except Exception as exc:
        ok, why = False, first_line(exc)
    else:
        why = "no key"
    finally:
        wandb.teardown()  # the settings the check read stay behind in W&B's process-wide state otherwise
    if not ok:
        raise ScenarioError(f"report.loggers: wandb runs online and has no login ({why}); fix: wandb login, or export "
                            "WANDB_API_KEY, or WANDB_MODE=offline to keep the run on this machine (wandb sync uploads it later)")


def _check_mlflow_server() -> None:
    uri = os.environ.get("MLFLOW_TRACKING_URI", "")
    parts = urllib.parse.urlsplit(uri)
    if parts.scheme not in ("http", "https"):
        return  # a local store, or a scheme MLflow's plugins resolve
    try:
        host, port = parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        host = port = None
    if not host:
        raise ScenarioError(f"report.loggers: MLFLOW_TRACKING_URI = {uri[:200]!r} names no host and port; "
                            "fix: export MLFLOW_TRACKING_URI=http://HOST:PORT, or unset it for a store in the run directory")
    proxies = urllib.request.getproxies()
    if parts.scheme in proxies and not urllib.request.proxy_bypass(host):
        return  # reached through a proxy: a connection of our own would tell nothing
    try:
        socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S).close()
    except OSError as exc:
        why = f"no answer in {CONNECT_TIMEOUT_S} s" if isinstance(exc, TimeoutError) else (exc.strerror or type(exc).__name__)
        raise ScenarioError(f"report.loggers: mlflow's tracking server {parts.scheme}://{host}:{port} (MLFLOW_TRACKING_URI) "
                            f"cannot be reached ({why}); fix: start it or correct MLFLOW_TRACKING_URI, or unset it for a store "
                            "in the run directory, or drop mlflow from report.loggers") from None


def as_line(event: Progress) -> dict:
    """The line of metrics.jsonl that tells ``event``."""
    if isinstance(event, StepTrained):
        line = {
            "event": "step", "step": event.step, "version": event.version, "time_s": event.at_s,
            "samples/trainings": event.trainings, "samples/trained": event.trained, "tokens/trained": event.tokens,
            "staleness/mean": event.staleness_total / event.trainings if event.trainings else 0.0,
            "staleness/max": event.staleness_max,
            "step/samples": event.samples,
            "step/staleness_mean": event.staleness_sum / event.samples if event.samples else 0.0,
        }
        line.update(_scalars("train/", event.figures))
    elif isinstance(event, WeightsSynced):
        line = {"event": "sync", "version": event.version, "time_s": event.at_s, "sync/pause_s": event.pause_s,
                "sync/drain_s": event.drain_s, "sync/transfer_s": event.transfer_s}
    elif isinstance(event, VersionPublished):
        line = {"event": "publish", "version": event.version, "time_s": event.at_s, "env/steps": event.env_steps,
                **_scalars("learner/", event.figures), "learner/updates": event.updates}
    elif isinstance(event, PolicyEvaluated):
        line = {"event": "eval", "version": event.version, "time_s": event.at_s, "env/steps": event.env_steps,
                "eval/return": _finite(event.eval_return)}
    else:
        raise TypeError(f"not a progress event: {event!r}")
    line["unix_s"] = round(time.time(), 3)
    return line


def plotted(line: dict) -> tuple[str, int, dict[str, float]]:
    """(x-axis name, x, scalars by tag) of a line, as the loggers plot it. A name without a
    namespace takes its event's: ``time_s`` of a step is ``step/time_s``."""
    kind = line["event"]
    axis = AXIS[kind]
    scalars = {}
    for key, value in line.items():
        if key in ("event", "unix_s", axis) or value is None:
            continue
        scalars[key if "/" in key else f"{kind}/{key}"] = float(value)
    return axis, int(line[axis]), scalars


class Sink(Protocol):
    """A logger: takes each line's scalars at its x; ``close`` once the mode ended (or failed)."""

    def write(self, axis: str, x: int, scalars: dict[str, float], unix_s: float) -> None: ...

    def close(self, failed: bool) -> None: ...


class TensorBoardSink:
    """Event files in the mode's own directory, so ``tensorboard --logdir RUN`` shows one run per
    mode (and seed, and variant), named by its path."""

    def __init__(self, where: Path) -> None:
        tensorboardx = importlib.import_module("tensorboardX")
        self.summary = importlib.import_module("tensorboardX.proto.summary_pb2").Summary
        self.writer = tensorboardx.FileWriter(str(where), max_queue=TENSORBOARD_QUEUE, flush_secs=TENSORBOARD_FLUSH_S)

    def write(self, axis: str, x: int, scalars: dict[str, float], unix_s: float) -> None:
        # One event per line holding all its scalars: the writer hands each event to its thread
        # through a pipe, and an event per scalar (SummaryWriter.add_scalar) cost a millisecond a step.
        values = [self.summary.Value(tag=tag, simple_value=value) for tag, value in scalars.items()]
        if values:
            self.writer.add_summary(self.summary(value=values), global_step=x, walltime=unix_s)

    def close(self, failed: bool) -> None:
        self.writer.close()


class WandbSink:
    """A W&B run per mode, in the scenario's group; its files under ``RUN/wandb``. W&B itself reads
    ``WANDB_MODE`` (``offline``: nothing leaves the machine; ``wandb sync`` uploads later),
    ``WANDB_PROJECT`` (else ``asyncrl``) and the login."""

    def __init__(self, root: Path, name: str, group: str, mode: str, config: dict) -> None:
        self.wandb = importlib.import_module("wandb")
        self.run = self.wandb.init(
            project=os.environ.get("WANDB_PROJECT", "asyncrl"), name=name, group=group, job_type=mode, dir=str(root),
            config=config, reinit="create_new",
            settings=self.wandb.Settings(console="off", init_timeout=CONNECT_TIMEOUT_S),  # the harness owns the terminal
        )
        self.defined: set[str] = set()

    def write(self, axis: str, x: int, scalars: dict[str, float], unix_s: float) -> None:
        # W&B's own step counts calls; each figure is plotted against its line's axis instead.
        x_name = f"axis/{axis.replace('/', '_')}"
        for key in (x_name, *scalars):
            if key not in self.defined:
                if key == x_name:
                    self.run.define_metric(key)
                else:
                    self.run.define_metric(key, step_metric=x_name)
                self.defined.add(key)
        self.run.log({x_name: x, **scalars})

    def close(self, failed: bool) -> None:
        self.run.finish(exit_code=1 if failed else 0)


class MlflowSink:
    """An MLflow run per mode in the scenario's experiment: in ``RUN/mlruns`` (a file store; ``mlflow
    ui --backend-store-uri RUN/mlruns``) unless ``MLFLOW_TRACKING_URI`` names a store or server."""

    def __init__(self, root: Path, name: str, experiment: str, tags: dict[str, str]) -> None:
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", str(CONNECT_TIMEOUT_S))
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", str(MLFLOW_RETRIES))
        mlflow = importlib.import_module("mlflow")
        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if uri is None:
            # MLflow 3 keeps its file store, the one local store mlflow-skinny can write, behind this opt-in.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            uri = (root / "mlruns").resolve().as_uri()
        self.metric = mlflow.entities.Metric
        self.client = mlflow.tracking.MlflowClient(tracking_uri=uri)
        found = self.client.get_experiment_by_name(experiment)
        experiment_id = found.experiment_id if found is not None else self.client.create_experiment(experiment)
        self.run_id = self.client.create_run(experiment_id, run_name=name, tags=tags).info.run_id

    def write(self, axis: str, x: int, scalars: dict[str, float], unix_s: float) -> None:
        ms = int(unix_s * 1000)
        self.client.log_batch(self.run_id, metrics=[self.metric(k, v, ms, x) for k, v in scalars.items()])

    def close(self, failed: bool) -> None:
        self.client.set_terminated(self.run_id, "FAILED" if failed else "FINISHED")


class MetricsStream:
    """One mode's live figures: ``record`` each event as it happens (the runtimes' progress
    callback); a context manager that closes every sink when the mode ends.

    ``where``: the mode's directory; ``root``: the run's (W&B's and MLflow's files); ``name``:
    the mode's run in W&B and MLflow (scenario, variant, seed, mode); ``resume``: the mode goes on
    from a checkpoint, its metrics.jsonl to be cut back to it."""

    def __init__(self, where: Path, loggers: tuple[str, ...], *, root: Path, name: str, group: str, mode: str,
                 config: dict, resume: bool = False) -> None:
        self.path = where / METRICS_FILE
        self.earlier: Optional[list[dict]] = read_history(self.path) if resume else None
        if resume:
            for old in where.glob(TENSORBOARD_FILES):  # written anew from the history kept
                old.unlink()
        self.sinks: list[Sink] = []
        try:
            for logger in loggers:
                if logger == "tensorboard":
                    self.sinks.append(TensorBoardSink(where))
                elif logger == "wandb":
                    self.sinks.append(WandbSink(root, name, group, mode, config))
                else:
                    self.sinks.append(MlflowSink(root, name, group, {"mode": mode, "scenario": group}))
            self.file = open(self.path, "a" if resume else "w", encoding="utf-8")
        except Exception as exc:
            started = len(self.sinks)
            self._close_sinks(failed=True)
            if started == len(loggers):  # every logger started: the metrics file failed
                raise
            raise LoggerFailed(
                f"report.loggers: {loggers[started]} could not start ({first_line(exc)}); fix: check its "
                "server, login and install (WANDB_MODE=offline or an MLFLOW_TRACKING_URI it can reach), or drop it from report.loggers"
            ) from None
        except BaseException:
            self._close_sinks(failed=True)
            raise

    def __enter__(self) -> "MetricsStream":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(failed=exc_type is not None)

    def record(self, event: Progress) -> None:
        line = as_line(event)
        if self.earlier is not None:
            self._resumed(_position(line))
        self._write(line)

    def close(self, failed: bool = False) -> None:
        if self.earlier is not None:  # resumed, and nothing happened since: the whole history stands
            self._resumed(None)
        self.file.close()
        self._close_sinks(failed)

    def _resumed(self, first: Optional[tuple]) -> None:
        """Keep what happened before the checkpoint the mode went on from (``first``: the
        position of its first event since), and give the loggers that history again."""
        kept = [line for line in self.earlier if first is None or _position(line) < first]
        self.earlier = None
        self.file.close()
        write_atomic(self.path, "".join(json.dumps(line) + "\n" for line in kept).encode())
        self.file = open(self.path, "a", encoding="utf-8")
        for line in kept:
            self._plot(line)

    def _write(self, line: dict) -> None:
        self.file.write(json.dumps(line) + "\n")
        self.file.flush()  # a reader sees every finished line while the run goes
        self._plot(line)

    def _plot(self, line: dict) -> None:
        axis, x, scalars = plotted(line)
        for sink in self.sinks:
            sink.write(axis, x, scalars, line["unix_s"])

    def _close_sinks(self, failed: bool) -> None:
        for sink in self.sinks:
            sink.close(failed)
        self.sinks = []


def read_history(path: Path) -> list[dict]:
    """The lines a stopped mode wrote to ``path`` (its metrics.jsonl; none if there is none),
    which its resume keeps: every line one asyncrl writes, but for a last one a kill cut short.
    ``MetricsFileError`` names the file and the line of anything else, so that a resume refuses
    it before anything runs (harness/run.py), instead of a traceback once the mode goes on."""
    if not os.path.lexists(path):
        return []
    fix = "delete it (the resumed mode then keeps none of its figures from before the checkpoint), or start the run again"
    try:
        data = read_regular(path, MAX_FILE_BYTES, fix, follow_links=False)
    except UnreadableFile as exc:
        raise MetricsFileError(str(exc)) from None
    lines = data.split(b"\n")
    rows = []
    for n, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        where = f"line {n}"
        try:
            line = loads_json(raw)
            problem = _line_problem(line)
        except UnicodeDecodeError as exc:
            problem = f"byte {exc.start} of the line is not UTF-8"
        except TooNested as exc:
            where, problem = f"line {n}, column {exc.column}", exc.problem
        except ValueError as exc:
            problem = f"not JSON ({str(exc)[:80]})"
        if problem is None:
            rows.append(line)
        elif n == len(lines) and (raw.startswith(_LINE_HEAD) or _LINE_HEAD.startswith(raw)):
            break  # the last line, unterminated: a write the kill cut short
        else:
            raise MetricsFileError(f"{path}: {where}: {problem}, not a line asyncrl writes; fix: {fix}")
    return rows


def _line_problem(line: object) -> Optional[str]:
    """What keeps ``line`` from being one ``as_line`` wrote (what the resume's loggers and
    ``_position`` read of it); None if nothing."""
    if not isinstance(line, dict):
        return f"a JSON {type(line).__name__}, not an object"
    event = line.get("event")
    if not isinstance(event, str) or event not in AXIS:
        return f"event = {str(event)[:40]!r} is not one of {', '.join(AXIS)}"
    axis = AXIS[event]
    for key in (axis, "unix_s"):
        if key not in line:
            return f"it has no {key}"
    for key, value in line.items():
        if key == "event" or (value is None and key not in (axis, "unix_s")):
            continue
        whole = key in (axis, "version")
        if not _is_number(value, whole):
            return f"{key[:40]} = {str(value)[:40]} is not a {'whole ' if whole else ''}number"
    return None


def _is_number(value: object, whole: bool) -> bool:
    if isinstance(value, bool):
        return False
    return isinstance(value, int) or (not whole and isinstance(value, float))


def _position(line: dict) -> tuple:
    """Where a line falls in its run: by version, a version's sync (or publication) before its
    steps (or evaluations), then along its axis."""
    version = line.get("version")
    return (-1 if version is None else version, 0 if line["event"] in ("sync", "publish") else 1, line[AXIS[line["event"]]])


def _scalars(prefix: str, figures: dict) -> dict:
    """The figures that are one number each, named under ``prefix``."""
    return {prefix + k: _finite(v) for k, v in figures.items() if isinstance(v, numbers.Real)}


def _finite(v: numbers.Real) -> Optional[float | int]:
    """JSON has no NaN or infinity: such a figure is written as null."""
    if isinstance(v, bool):
        return int(v)
    if isinstance(v, numbers.Integral):
        return int(v)
    v = float(v)
    return v if math.isfinite(v) else None
