"""Offline batch inference: a directory of inputs in, one result file per input out, resumable.

Inputs, processed in sorted order: `<stem>.npy` (models with one input; one sample, or a batch with
the leading batch axis) or `<stem>.npz` (arrays named after the model inputs). For each input the
runner writes `<output_dir>/<stem>.npz` holding every model output, atomically (temp + fsync +
rename), so a crash leaves whole results or none. String (BYTES) tensors are numpy unicode arrays
('<U..') both ways, read and written without pickles (allow_pickle stays off). On start it skips inputs whose result exists
and removes temp files a crashed run left behind: finished work is never repeated or lost.

All instances pull files from one shared queue. Each lane reads its next file while its instance
computes the current one, so the instance does not wait for the disk or the decoding. A bad input file does not stop the others: it is
recorded (`input_failed` event, with the file and the inputs the model expects) and the run ends
as failed once everything else is done. A file that crashes a worker is retried on a fresh worker
up to MAX_ATTEMPTS times.
"""
from __future__ import annotations

import io
import math
import os
import queue
import stat
import threading
import time
import zipfile
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Union

import numpy as np

from reamer.host.errors import ReamerError
from reamer.host.sched import set_nice
from reamer.serve.spec import append_event, is_temp_file, write_atomic
from reamer.serve.protocol.tensors import BadBytesTensor, TensorInfo, as_text_array, storable_text, v2_to_numpy
from reamer.serve.runtime.instances import InstanceCrashed, InstanceWorker, WorkerError

INPUT_SUFFIXES = (".npy", ".npz")
# The runner's own threads (reading inputs, handing batches over, writing results) run at this nice
# value, below the instances: on cores the instances keep busy, a woken instance then preempts them at
# once instead of waiting out their time slice (a few ms per batch, measured), and they still get the
# few ms of CPU per file they need.
HOUSEKEEPING_NICE = 19
MAX_ATTEMPTS = 3


class OfflineInputError(ReamerError):
    """An input directory or file the model cannot take."""


@dataclass(frozen=True)
class OfflineProgress:
    done: int  # inputs with a result (including ones finished by an earlier run)
    total: int
    failed: int
    throughput: float  # samples per second in this run
    eta_s: float | None
    finished: bool


@dataclass
class _Item:
    path: Path
    attempts: int = 0


@dataclass
class _Lane:
    worker: InstanceWorker
    thread: threading.Thread | None = None
    retiring: threading.Event = field(default_factory=threading.Event)
    # the lane's result being written (at most one): the write (with its fsync) overlaps the next batch
    writing: Future | None = None


def result_path(output_dir: str | os.PathLike, input_path: str | os.PathLike) -> Path:
    return Path(output_dir) / f"{Path(input_path).stem}.npz"


def list_inputs(input_dir: str | os.PathLike) -> list[Path]:
    """The input files of a job, sorted; rejects two inputs that would write the same result."""
    d = Path(input_dir)
    if not d.is_dir():
        raise OfflineInputError(f"input directory {d} does not exist", "create it and put .npy/.npz files in it")
    files = sorted(p for p in d.iterdir() if p.suffix in INPUT_SUFFIXES and p.is_file() and not p.name.startswith("."))
    stems: dict[str, Path] = {}
    for p in files:
        if p.stem in stems:
            raise OfflineInputError(f"inputs {stems[p.stem].name} and {p.name} would both write {p.stem}.npz",
                                    "rename one of them")
        stems[p.stem] = p
    return files


def _describe(inputs: list[TensorInfo]) -> str:
    return ", ".join(f"{t.name} ({t.datatype} {list(t.shape)})" for t in inputs)


def _npy_from_bytes(data: bytes) -> np.ndarray:
    """An .npy file held in memory, as a (read-only) view of it."""
    fmt = np.lib.format
    buf = io.BytesIO(data)
    version = fmt.read_magic(buf)
    if version not in ((1, 0), (2, 0)):
        return fmt.read_array(buf, allow_pickle=False)
    shape, fortran, dtype = (fmt.read_array_header_1_0 if version == (1, 0) else fmt.read_array_header_2_0)(buf)
    if dtype.hasobject:
        raise ValueError("the array holds Python objects, which reamer does not load (allow_pickle is off)")
    arr = np.frombuffer(data, dtype, count=math.prod(shape), offset=buf.tell())
    return arr.reshape(shape, order="F" if fortran else "C")


def read_npz(path: Path) -> dict[str, np.ndarray]:
    """The arrays of an .npz file. About 4x faster than np.load for a 600 KB image, whose per-member
    stream reads cost more CPU than the offline job's whole hand-off to an instance; the zip CRC is
    still checked."""
    with zipfile.ZipFile(path) as z:
        return {name[:-4] if name.endswith(".npy") else name: _npy_from_bytes(z.read(name)) for name in z.namelist()}


def load_inputs(path: Path, model_inputs: list[TensorInfo]) -> tuple[dict[str, np.ndarray], bool]:
    """Read one input file as model inputs with a batch axis; also says whether it held a single sample."""
    expected = _describe(model_inputs)
    fix = (f"save a .npy (models with one input) or a .npz with arrays named {[t.name for t in model_inputs]}; "
           f"the model expects {expected}")

    def bad(problem: str) -> OfflineInputError:
        return OfflineInputError(f"input file {path.name}: {problem}; the model expects inputs: {expected}", fix)

    try:
        if path.suffix == ".npy":
            if len(model_inputs) != 1:
                raise bad("a .npy file holds one array but the model has several inputs")
            arrays = {model_inputs[0].name: np.load(path, allow_pickle=False)}
        else:
            arrays = read_npz(path)
    except OfflineInputError:
        raise
    except Exception as exc:  # noqa: BLE001 - numpy raises many kinds for broken files
        raise bad(f"cannot be read ({exc})") from None
    names = {t.name for t in model_inputs}
    if set(arrays) != names:
        raise bad(f"it holds arrays {sorted(arrays)}")
    out: dict[str, np.ndarray] = {}
    singles = set()
    for info in model_inputs:
        arr = arrays[info.name]
        want = v2_to_numpy(info.datatype)
        if info.datatype == "BYTES":  # strings: a numpy unicode ('<U..') or bytes ('S..', UTF-8) array
            if arr.dtype.kind not in "US":
                raise bad(f"array {info.name!r} is {arr.dtype}, not strings (save it as a numpy unicode "
                          "array, e.g. np.array(['first', 'second']))")
            try:
                arr = as_text_array(arr, f"array {info.name!r}")
            except BadBytesTensor as exc:
                raise bad(exc.message) from None
        elif arr.dtype != want:
            if not np.can_cast(arr.dtype, want, casting="same_kind"):
                raise bad(f"array {info.name!r} is {arr.dtype}, not {want}")
            arr = arr.astype(want)
        if arr.ndim == len(info.shape) - 1:
            arr, single = arr[np.newaxis], True
        elif arr.ndim == len(info.shape):
            single = False
        else:
            raise bad(f"array {info.name!r} has shape {list(arr.shape)}")
        if any(m >= 0 and d != m for d, m in zip(arr.shape[1:], info.shape[1:])):
            raise bad(f"array {info.name!r} has shape {list(arr.shape)}")
        singles.add(single)
        out[info.name] = arr
    if len(singles) > 1 or len({a.shape[0] for a in out.values()}) > 1:
        raise bad("its arrays disagree on the batch size")
    return out, singles == {True}


_Loaded = Union[tuple[dict[str, np.ndarray], bool], OfflineInputError]  # a read input file, or why not


def _load(item: _Item, model_inputs: list[TensorInfo]) -> _Loaded:
    try:
        return load_inputs(item.path, model_inputs)
    except OfflineInputError as exc:
        return exc


def _own_regular_file(path: Path) -> bool:
    """A plain file this process's user owns (temp files of others, and symlinks, are never deleted)."""
    try:
        info = path.lstat()
    except OSError:
        return False
    return stat.S_ISREG(info.st_mode) and info.st_uid == os.geteuid()


def _yield_to_instances() -> None:
    try:
        set_nice(threading.get_native_id(), HOUSEKEEPING_NICE)
    except ReamerError:
        pass  # the thread runs at the process's priority: slower to give way, still correct


class OfflineRunner:
    def __init__(self, input_dir: str | os.PathLike, output_dir: str | os.PathLike,
                 run_dir: str | os.PathLike | None = None) -> None:
        self.input_dir = Path(input_dir)
        self.output_dir = Path(output_dir)
        self.run_dir = run_dir
        # made here, by the job's process (its user's rights), never by the agent: no link in the path can
        # make root create anything
        try:
            self.output_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise OfflineInputError(f"output directory {self.output_dir} cannot be created by uid {os.geteuid()}: "
                                    f"{exc.strerror}", "give an output_dir the job's user can create and write "
                                    "(check every directory above it)") from None
        for name in os.listdir(self.output_dir):
            if is_temp_file(name) and _own_regular_file(self.output_dir / name):  # cut off by an earlier crash
                (self.output_dir / name).unlink(missing_ok=True)
        files = list_inputs(self.input_dir)
        pending = [p for p in files if not result_path(self.output_dir, p).exists()]
        self.total = len(files)
        self._done = self.total - len(pending)
        self._queue: queue.Queue[_Item] = queue.Queue()
        for p in pending:
            self._queue.put(_Item(p))
        self.failures: list[tuple[str, str]] = []
        self._samples = 0
        self._files_this_run = 0
        self._started = time.monotonic()
        self._lanes: list[_Lane] = []
        self._lock = threading.Lock()
        self._writer = ThreadPoolExecutor(max_workers=2, thread_name_prefix="offline-write",
                                          initializer=_yield_to_instances)
        self._stop = threading.Event()
        self.all_done = threading.Event()
        self._check_finished()

    # -- instances
    @property
    def workers(self) -> list[InstanceWorker]:
        return [lane.worker for lane in self._lanes if not lane.retiring.is_set()]

    def add_instance(self, worker: InstanceWorker) -> None:
        lane = _Lane(worker)
        lane.thread = threading.Thread(target=self._serve, args=(lane,), name=f"offline-{worker.index}", daemon=True)
        self._lanes.append(lane)
        lane.thread.start()

    def remove_instance(self, worker: InstanceWorker, timeout_s: float = 60.0) -> None:
        """Stop handing files to `worker`; its current file finishes; then its process stops."""
        lane = next((ln for ln in self._lanes if ln.worker is worker), None)
        if lane is None:
            return
        lane.retiring.set()
        worker.request_stop()  # no restart of a retiring worker; its current file still finishes
        if lane.thread is not None:
            lane.thread.join(timeout_s)
        worker.stop()
        self._lanes.remove(lane)

    def stop(self) -> None:
        """Stop all instances after their current files."""
        self._stop.set()
        for lane in list(self._lanes):
            self.remove_instance(lane.worker)
        self._writer.shutdown(wait=True)

    # -- progress
    def progress(self) -> OfflineProgress:
        with self._lock:
            elapsed = max(time.monotonic() - self._started, 1e-6)
            remaining = self.total - self._done - len(self.failures)
            files_rate = self._files_this_run / elapsed
            eta = remaining / files_rate if files_rate > 0 else (0.0 if remaining == 0 else None)
            return OfflineProgress(done=self._done, total=self.total, failed=len(self.failures),
                                   throughput=self._samples / elapsed, eta_s=eta, finished=self.all_done.is_set())

    def _check_finished(self) -> None:
        if self._done + len(self.failures) >= self.total:
            self.all_done.set()

    def failure_summary(self) -> str:
        if not self.failures:
            return ""
        shown = "; ".join(msg for _, msg in self.failures[:3])
        more = f" (and {len(self.failures) - 3} more)" if len(self.failures) > 3 else ""
        return f"{len(self.failures)} input file(s) could not be processed: {shown}{more}"

    # -- work
    def _fail(self, item: _Item, message: str) -> None:
        with self._lock:
            self.failures.append((item.path.name, message))
            self._check_finished()
        if self.run_dir:
            append_event(self.run_dir, "input_failed", message, file=str(item.path))

    def _serve(self, lane: _Lane) -> None:
        _yield_to_instances()
        worker = lane.worker
        next_up: tuple[_Item, _Loaded] | None = None  # read while the instance computed the last file

        def read_next() -> None:
            nonlocal next_up
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            next_up = (item, _load(item, worker.inputs))

        try:
            while not lane.retiring.is_set() and not self._stop.is_set() and not self.all_done.is_set():
                if not worker.ensure_running():
                    if worker.stopping:
                        return
                    lane.retiring.wait(0.25)
                    continue
                if next_up is None:
                    try:
                        item = self._queue.get(timeout=0.2)
                    except queue.Empty:
                        continue
                    loaded = _load(item, worker.inputs)
                else:
                    (item, loaded), next_up = next_up, None
                self._process(lane, item, loaded, read_next)
        finally:
            if next_up is not None:
                self._queue.put(next_up[0])  # not started: another lane (or the next run) takes it
            self._flush(lane)

    @staticmethod
    def _flush(lane: _Lane) -> None:
        if lane.writing is not None:
            lane.writing.result()
            lane.writing = None

    def _process(self, lane: _Lane, item: _Item, loaded: _Loaded, read_next: Callable[[], None]) -> None:
        worker = lane.worker
        if isinstance(loaded, OfflineInputError):
            self._fail(item, str(loaded))
            return
        inputs, single = loaded
        first = next(iter(inputs.values()))
        n = first.shape[0] if first.ndim else 1
        # a model that is not batchable (batchability.py) runs each file whole: its rows are no batch to split
        batchable = worker.batchability is None or worker.batchability.batchable
        step = worker.spec.max_batch if batchable else max(n, 1)
        parts: list[dict[str, np.ndarray]] = []
        try:
            for start in range(0, n, step):
                last = start + step >= n
                parts.append(worker.run({k: v[start:start + step] for k, v in inputs.items()} if batchable else inputs,
                                        meanwhile=read_next if last else None))
        except InstanceCrashed as exc:
            item.attempts += 1
            if item.attempts >= MAX_ATTEMPTS:
                self._fail(item, f"input file {item.path.name}: the worker crashed {item.attempts} times on it ({exc.message})")
            else:
                self._queue.put(item)  # another (or the restarted) instance retries it
            return
        except WorkerError as exc:
            if worker.stopping:
                self._queue.put(item)
            else:
                self._fail(item, f"input file {item.path.name}: {exc.message}")
            return
        outputs = {k: (np.concatenate([p[k] for p in parts]) if len(parts) > 1 else parts[0][k]) for k in parts[0]}
        if single:
            outputs = {k: (v[0] if v.ndim and v.shape[0] == 1 else v) for k, v in outputs.items()}
        self._flush(lane)  # one write in flight per lane bounds the results held in memory
        lane.writing = self._writer.submit(self._write_result, item, outputs, n)

    def _write_result(self, item: _Item, outputs: dict[str, np.ndarray], n: int) -> None:
        buf = io.BytesIO()
        # BYTES outputs as numpy unicode arrays: an object array would be pickled, and readers would need
        # allow_pickle=True to open the result
        np.savez(buf, **{name: storable_text(a) if np.asarray(a).dtype.kind in "OSU" else a
                         for name, a in outputs.items()})
        try:
            write_atomic(result_path(self.output_dir, item.path), buf.getvalue(), replace=False)
        except FileExistsError:
            self._fail(item, f"input file {item.path.name}: its result file appeared meanwhile and this job did not "
                       "write it; it is left as it is (move it away and deploy again)")
            return
        except OSError as exc:
            self._fail(item, f"input file {item.path.name}: cannot write its result: {exc}")
            return
        with self._lock:
            self._done += 1
            self._files_this_run += 1
            self._samples += n
            self._check_finished()
