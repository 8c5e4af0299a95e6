"""Where the windows are scored: in this process, or on Ray actors that each hold one ONNX Runtime session.

    with cluster.pool(workers=2) as pool:            # a local Ray cluster of 2 CPUs, started and stopped here
    with cluster.pool(address="HOST:6379") as pool:  # an existing Ray cluster, left running
    with cluster.pool() as pool:                     # no Ray: this process, two runs at a time (`concurrent`)
        actors = pool.actors(model, make)            # each actor builds make(model) at its first call (a session, a Scorer)
        for result in actors.map("run", [args, ...], **common):  # obj.run(*args, **common) per job, in job order

In this process, `concurrent` jobs run at once on threads sharing the object (ONNX Runtime runs one session
from several threads, and releases the GIL), each session with cores / concurrent intra-op threads: small
runs scale better over runs than over the threads of one run.

The driver reduces the results, in job order, so a sum over windows adds the same numbers in the same
order whichever way they were computed. Ray is optional: `pip install 'surgery[ray]'`. Each actor takes one
CPU and runs its session with one intra-op thread; a model's external data files must be on a path every
worker can read. With `device` cuda (or auto on a cluster that has GPUs) each actor also asks Ray for a GPU
(num_gpus 1, or an equal share when the cluster has fewer GPUs than actors) and runs on CUDA; an actor whose
session cannot start there fails the run in one line naming its host. A value every job reads (the
reference log-probs) goes to the object store once (`share`).

An actor that dies is restarted by Ray (max_restarts) and the job it was running runs again (max_task_retries),
up to RETRIES times: a job's work is a pure function of its arguments, so the redone job returns what the lost
one would have. An actor builds its object at its first call (and again after a restart) from the model's
reference, which each call carries and the Remote keeps alive.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import logging
import os
import socket
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import onnx_ir as ir
from threadpoolctl import threadpool_limits

from surgery.engine import runtime
from surgery.errors import SurgeryError

RETRIES = 3  # times Ray restarts a dead actor and runs its job again


class Local:
    """One object in this process; `map` calls it job by job, `concurrent` jobs at a time, in job order."""

    def __init__(self, obj: Any, concurrent: int = 1):
        self.obj, self.concurrent = obj, concurrent

    def share(self, value: Any) -> Any:
        """A value many jobs read, handed over once (here: itself)."""
        return value

    def map(self, method: str, jobs: Sequence[tuple], unit: str = "", **common) -> Iterator:
        """obj.method(*args, **common) for each job's args, results in job order; `unit` names the work (for Remote's errors)."""
        call = lambda args: getattr(self.obj, method)(*args, **common)  # noqa: E731
        if self.concurrent == 1:
            yield from map(call, jobs)
            return
        # BLAS on one thread per job, set once here: threadpoolctl's limits are process-wide, not per thread
        with threadpool_limits(1, user_api="blas"), ThreadPoolExecutor(self.concurrent) as executor:
            yield from executor.map(call, jobs)


class Remote:
    """Ray actors each holding one object; `map` spreads the jobs over them and returns results in job order.

    An actor that dies (its node taken back, killed for memory) is restarted by Ray, which builds its object again
    and runs the job it was running again, up to RETRIES times; a job that still fails stops the run in one line
    naming the job and the host it ran on."""

    def __init__(self, actors: list, model):
        self.actors, self.model = actors, model  # the model's reference, kept while the actors may need it (a restarted one loads it again)
        self.hosts = [actor.host.remote() for actor in actors]  # asked once, while the actors live: named in errors

    def share(self, value: Any) -> Any:
        """A value many jobs read, put in Ray's object store once: a job argument that is the returned reference
        reaches the actor as the value, without travelling with every job."""
        import ray

        return ray.put(value)

    def map(self, method: str, jobs: Sequence[tuple], unit: str = "", **common) -> Iterator:
        import ray

        jobs, idle, running, done, first = list(jobs), list(range(len(self.actors))), {}, {}, 0
        for i in range(len(jobs)):
            while not idle:  # wait for an actor to finish a job, then hand it the next
                [ready], _ = ray.wait(list(running), num_returns=1)
                j, a = running.pop(ready)
                done[j] = self._result(ready, method, j, a, unit)
                idle.append(a)
                while first in done:
                    yield done.pop(first)
                    first += 1
            a = idle.pop(0)
            running[self.actors[a].call.remote([self.model], method, jobs[i], common)] = (i, a)
        for ref, (j, a) in sorted(running.items(), key=lambda item: item[1][0]):
            done[j] = self._result(ref, method, j, a, unit)
        while first in done:
            yield done.pop(first)
            first += 1

    def _result(self, ref, method: str, job: int, actor: int, unit: str):
        """A job's result; its failure as one line: a worker's SurgeryError as it said it, an actor that died too often named."""
        import ray
        import ray.exceptions

        try:
            return ray.get(ref)
        except ray.exceptions.RayTaskError as e:  # a worker's SurgeryError is the user's one line, not Ray's traceback
            if isinstance(e.cause, SurgeryError):
                raise SurgeryError(str(e.cause)) from None
            raise
        except ray.exceptions.RayActorError:
            try:
                host = ray.get(self.hosts[actor], timeout=5)
            except Exception:  # noqa: BLE001 - the actor never said: name what Ray knows
                host = "an unknown host"
            what = f"{unit} (job {job})" if unit else f"{method} job {job}"
            raise SurgeryError(f"the Ray worker at {host} died {RETRIES + 1} times running {what}; check that host's memory and "
                               "logs, and rerun (a main job resumes from its checkpoints)") from None


@dataclasses.dataclass(frozen=True)
class Resources:
    """Where a command runs its windows: ONNX Runtime's session options, and a Ray cluster (`--workers`, `--ray`) or this process."""

    options: runtime.Options = runtime.Options()
    workers: int | None = None  # a local Ray cluster of this many CPUs, started and stopped by `pool`
    ray: str | None = None  # the address of a running Ray cluster

    def pool(self, concurrent: int = 1) -> "contextlib.AbstractContextManager[Pool]":
        """`pool(workers, ray, ...)` on the options' device."""
        return pool(self.workers, self.ray, concurrent=concurrent, device=self.options.device)


@dataclasses.dataclass
class Pool:
    """What `pool()` yields: `workers` Ray actors per `actors` call, or, when workers is 0, this process
    running `concurrent` jobs at a time."""

    workers: int = 0
    concurrent: int = 1
    local: bool = False  # the Ray actors run on this machine (a cluster pool() started)
    gpus: float = 0.0  # per actor: its share of a GPU, when the actors run on CUDA

    @property
    def distributed(self) -> bool:
        return self.workers > 0

    @property
    def copies(self) -> int:
        """How many copies of what each actor holds (a fit pass's sums) share this machine's memory: the
        driver's, and each actor's when they run here."""
        return 1 + self.workers if self.local else 1

    @property
    def parallel(self) -> int:
        """How many jobs run at once."""
        return self.workers if self.distributed else self.concurrent

    def options(self, options: runtime.Options) -> runtime.Options:
        """Session options for the objects `make` builds: one intra-op thread per Ray actor; in this process,
        the cores shared by the concurrent jobs."""
        if self.distributed:
            return dataclasses.replace(options, threads=1, device="cuda" if self.gpus else "cpu")
        if self.concurrent > 1:
            return dataclasses.replace(options, threads=max(1, (os.cpu_count() or 1) // self.concurrent))
        return options

    def actors(self, model: ir.Model, make: Callable[[ir.Model], Any]) -> Local | Remote:
        """Objects built by `make(model)` (a picklable function: a module-level one or a functools.partial)."""
        if not self.distributed:
            return Local(make(model), self.concurrent)
        import ray

        return Remote([_holder().options(num_gpus=self.gpus).remote(make) for _ in range(self.workers)], ray.put(runtime.Portable.of(model)))


def concurrency(options: runtime.Options) -> int:
    """Jobs to run at once in this process: 2 on a CPU with 2 or more cores when the intra-op threads are
    ORT's choice; 1 when they are given (the user chose them) or on CUDA."""
    if options.threads is not None or (os.cpu_count() or 1) < 2 or runtime.providers(options.device)[0] != runtime.CPU:
        return 1
    return 2


@contextlib.contextmanager
def pool(workers: int | None = None, address: str | None = None, concurrent: int = 1, device: str = "auto",
         gpus: int | None = None) -> Iterator[Pool]:
    """A Pool over a local Ray cluster of `workers` CPUs (started and stopped here), over the Ray cluster at
    `address` (as many actors as it has CPUs), or, with neither, this process running `concurrent` jobs at once.

    device: where the actors run their sessions: `cuda` (each actor asks Ray for a GPU, or an equal share of the
    cluster's GPUs when there are fewer GPUs than actors; a cluster without GPUs is an error), `cpu`, or `auto`
    (CUDA when the cluster has GPUs). gpus: the GPUs a local cluster declares (Ray detects them when None)."""
    if not workers and not address:
        yield Pool(concurrent=concurrent)
        return
    if workers is not None and workers < 1:
        raise SurgeryError(f"--workers {workers}: give 1 or more Ray workers, or leave it out to run in this process")
    try:
        import ray
    except ImportError:
        raise SurgeryError("--workers and --ray need Ray; run `pip install 'surgery[ray]'`") from None
    printed = io.StringIO()  # Ray prints notices (token authentication) at start: they go to this module's logger instead
    try:
        with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
            if address:
                ray.init(address=address, log_to_driver=False, configure_logging=False)
            else:
                ray.init(num_cpus=workers, num_gpus=gpus, include_dashboard=False, log_to_driver=False, configure_logging=False)
    except (ConnectionError, RuntimeError, ValueError) as e:
        raise SurgeryError(f"cannot start Ray ({str(e).splitlines()[0] if str(e) else type(e).__name__}); check --ray ADDRESS") from None
    for line in printed.getvalue().splitlines():
        logging.getLogger(__name__).warning(line)
    try:
        resources = ray.cluster_resources()
        actors = workers or max(1, int(resources.get("CPU", 1)))
        yield Pool(actors, local=not address, gpus=_gpu_share(device, resources.get("GPU", 0), actors))
    finally:
        ray.shutdown()


def _gpu_share(device: str, gpus: float, actors: int) -> float:
    """Each actor's num_gpus: 1, or gpus / actors when the cluster has fewer GPUs than actors; 0 on the CPU."""
    if device == "cpu" or (device == "auto" and not gpus):
        return 0.0
    if not gpus:
        raise SurgeryError("--device cuda: the Ray cluster has no GPU for its workers; start it on GPU nodes, or use --device cpu")
    return min(1.0, gpus / actors)


def _on_this_host(error: SurgeryError) -> SurgeryError:
    return SurgeryError(f"on the Ray worker at {socket.gethostname()}: {error}")


@functools.cache
def _holder():
    """The Ray actor class, made on first use (importing ray is slow, and optional) and the same class after."""
    import ray

    @ray.remote(num_cpus=1, max_restarts=RETRIES, max_task_retries=RETRIES)
    class Holder:
        def __init__(self, make):
            self.make, self.obj, self.failed = make, None, None

        def host(self) -> str:
            return socket.gethostname()

        def call(self, model: list, method: str, args: tuple, common: dict):
            """obj.method(*args, **common), obj made by make() from the model (model[0], a reference: in a list, so that
            Ray hands it over unread) at the first call, and again at the first call after a restart."""
            if self.obj is None and self.failed is None:
                try:
                    self.obj = self.make(ray.get(model[0]).load())
                except SurgeryError as e:  # raised at every call, where the driver reads it
                    self.failed = _on_this_host(e)
            if self.failed is not None:
                raise self.failed
            args = tuple(ray.get(a) if isinstance(a, ray.ObjectRef) else a for a in args)  # Remote.share's values
            try:
                return getattr(self.obj, method)(*args, **common)
            except SurgeryError as e:
                raise _on_this_host(e) from None

    return Holder
