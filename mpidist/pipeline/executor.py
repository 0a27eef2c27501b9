"""The executor: runs one rank's program of a pipeline schedule for one training step.

Transfers are nonblocking: a RECV posts an Irecv into a pooled buffer one compute ahead, and
the compute that needs it waits; a SEND posts an Isend that completes in the background
(pipeline.transport: a helper thread keeps MPI progressing where the transport needs it). A
SEND that directly follows its compute is posted from within that compute as soon as the
output exists, so the receiver does not wait on the bookkeeping between computes. Shapes and
dtypes cross each stage boundary once, so later transfers land in reused buffers.
Activations in flight are stashed per (micro-batch, stage): the layer caches, or with
`recompute=True` only the stage's input, from which the backward re-runs the forward.
See docs/ARCHITECTURE.md (pipeline).
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field

import numpy as np
from mpi4py import MPI

from mpidist.comm import Communicator
from mpidist.kernels.backend import byte_view, get_array_module
from mpidist.nn.loss import SoftmaxCrossEntropy
from mpidist.pipeline.actions import (BACKWARD, FORWARD, RECV_B, RECV_F, SEND_B, SEND_F,
                                      Action, Schedule)
from mpidist.pipeline.stage import Stage, stash_nbytes
from mpidist.pipeline.transport import BufferPool, ProgressThread, single_copy

__all__ = ["PipelineExecutor", "StepStats", "single_copy"]


@dataclass
class StepStats:
    """What one pipeline step did on this rank (loss and correct are pipeline-wide sums)."""
    loss_sum: float
    correct: int
    wall: float                  # seconds from the common start to this rank's last action
    busy: float                  # seconds of forward/backward compute
    peak_in_flight: int          # most micro-batch chunks stashed at once
    peak_stash_bytes: int        # their bytes at that high-water mark
    microbatch_stash_bytes: int  # bytes one micro-batch chunk stashes (the largest seen)
    events: list = field(default_factory=list)  # (kind, microbatch, stage, t0, t1)


class PipelineExecutor:
    """Runs `schedule` on this rank's stages over the pipeline communicator.

    comm: the pipeline group (its rank r holds virtual stages r, r + pp, ...; size pp).
    stages: {virtual stage: Stage} for those stages, bound to parameters and gradients.
    loss: forward(logits, targets) -> (loss sum, correct), backward(scale) -> dlogits.
    progress_thread: drive MPI progress from a helper thread while computing (default: when
      MPI runs with MPI_THREAD_MULTIPLE and the transfers need it: not single_copy(comm);
      see pipeline.transport.ProgressThread).
    """

    def __init__(self, schedule: Schedule, stages: dict[int, Stage], comm: Communicator, *,
                 loss=None, recompute: bool = False, progress_thread: bool | None = None):
        if not isinstance(schedule, Schedule):
            raise TypeError(f"schedule must be a pipeline Schedule, got {type(schedule).__name__}")
        if not isinstance(comm, Communicator):
            raise TypeError(f"comm must be an mpidist Communicator, got {type(comm).__name__}")
        if comm.size != schedule.pp:
            raise ValueError(f"schedule for {schedule.pp} pipeline ranks run on a "
                             f"communicator of {comm.size}")
        mine = schedule.local_stages(comm.rank)
        if sorted(stages) != mine:
            raise ValueError(f"pipeline rank {comm.rank} must hold stages {mine}, got "
                             f"{sorted(stages)}")
        self.schedule, self.stages, self.comm = schedule, dict(stages), comm
        self.loss = SoftmaxCrossEntropy() if loss is None else loss
        self.recompute = bool(recompute)
        multiple = MPI.Query_thread() == MPI.THREAD_MULTIPLE
        if progress_thread and not multiple:
            raise RuntimeError("progress_thread=True needs MPI initialised with "
                               "MPI_THREAD_MULTIPLE (mpi4py's default thread level)")
        self.progress_thread = (multiple and not single_copy(comm)) if progress_thread is None \
            else bool(progress_thread)
        self.program = [a for a in schedule.programs[comm.rank] if a is not None]
        # compute -> its SEND where that comes right after it: posted from within the
        # compute, as soon as the output exists (before the stash bookkeeping), and skipped
        # when the program reaches it
        follows = {FORWARD: SEND_F, BACKWARD: SEND_B}
        self._send_after = {a: b for a, b in zip(self.program, self.program[1:])
                            if b == Action(follows.get(a.kind), a.microbatch, a.stage)}
        self._sent_early = set(self._send_after.values())
        self._last = schedule.num_stages - 1
        self._meta_tag = 2 * schedule.num_stages
        self._probe_tag = 3 * schedule.num_stages       # no message ever carries it
        self._pool = BufferPool()
        self._key = None               # micro-batch shape/dtype the metadata belongs to
        self._meta_in: dict[int, tuple] = {}    # stage -> (shape, dtype) of its input
        self._meta_out: dict[int, tuple] = {}   # stage -> (shape, dtype) of its output
        self._meta_sent: set[int] = set()
        self._helper: ProgressThread | None = None

    # ------------------------------------------------------------------ tags and peers
    def _act_tag(self, sender_stage: int) -> int:
        return 2 * sender_stage

    def _grad_tag(self, sender_stage: int) -> int:
        return 2 * sender_stage + 1

    # ------------------------------------------------------------------ one step
    def run(self, x, y, *, scale: float | None = None, train: bool = True) -> StepStats:
        """One forward/backward over the batch (x, y), split into the schedule's
        micro-batches; gradients ACCUMULATE into the stages' grad views.

        Every rank of the pipeline passes the same batch (the first stage reads x, the last
        reads y). scale multiplies the summed loss's gradient: default 1 / y.size (the
        mean over this batch); data parallelism passes 1 / (global count).
        """
        use_thread = self.progress_thread and self.schedule.pp > 1
        helper = ProgressThread(self.comm.comm, self._probe_tag) if use_thread else None
        with helper if helper is not None else nullcontext():
            self._helper = helper
            return self._run(x, y, scale, train)

    def _run(self, x, y, scale, train) -> StepStats:
        m = self.schedule.microbatches
        shapes = (tuple(x.shape), str(x.dtype), tuple(y.shape), str(y.dtype))
        # the first collective of the step is also the common start of its timeline
        self.comm.check_same(shapes, "pipeline batch shape/dtype")
        if x.shape[0] % m or y.shape[0] != x.shape[0]:
            raise ValueError(f"the batch of {x.shape[0]} samples (targets {y.shape[0]}) must "
                             f"split into {m} equal micro-batches: use a batch size "
                             f"divisible by {m}")
        if shapes != self._key:
            self._key = shapes
            self._meta_in.clear()
            self._meta_out.clear()
            self._meta_sent.clear()
        b = x.shape[0] // m
        self._xs = [x[i * b:(i + 1) * b] for i in range(m)]
        self._ys = [y[i * b:(i + 1) * b] for i in range(m)]
        self._xp = get_array_module(x)
        self._scale = 1.0 / y.size if scale is None else float(scale)
        self._train = train
        self._recvs: dict[Action, tuple] = {}
        self._deferred: dict[tuple, int] = {}     # receives waiting for a shape, per channel
        self._local: dict[Action, object] = {}    # inputs handed over on this rank
        self._out: dict[tuple, object] = {}       # outputs / input grads waiting for a send
        self._stash: dict[tuple, tuple] = {}
        self._sends: list[tuple] = []
        self._releasing: list = []
        self._loss, self._correct = 0.0, 0
        self._in_flight = self._stash_bytes = 0
        stats = StepStats(0.0, 0, 0.0, 0.0, 0, 0, 0)
        self._stats = stats

        self._run_program(stats)
        for buf in self._releasing:
            self._pool.give(buf)
        self._releasing = []
        loss, correct = self._allreduce_metrics()
        stats.loss_sum, stats.correct = loss, correct
        return stats

    def _run_program(self, stats: StepStats) -> None:
        """This rank's actions in order; compute timed from a common start."""
        t_start = MPI.Wtime()
        handlers = {FORWARD: self._forward, BACKWARD: self._backward, RECV_F: self._post_recv,
                    RECV_B: self._post_recv, SEND_F: self._send, SEND_B: self._send}
        for action in self.program:
            if action.kind in (FORWARD, BACKWARD):
                data = self._input(action)            # waiting for it is idle time
                if self._helper is None:              # else the helper drives progress
                    self._progress()
                helping = self._helper is not None and bool(self._sends or self._recvs)
                if helping:
                    self._helper.computing.set()
                t0 = MPI.Wtime()
                handlers[action.kind](action, data)
                t1 = MPI.Wtime()
                if helping:
                    self._helper.computing.clear()
                stats.busy += t1 - t0
                stats.events.append((action.kind, action.microbatch, action.stage,
                                     t0 - t_start, t1 - t_start))
            elif action not in self._sent_early:
                handlers[action.kind](action)
        MPI.Request.Waitall([r for r, _ in self._sends])
        stats.wall = MPI.Wtime() - t_start
        self._sends = []

    def _allreduce_metrics(self) -> tuple[float, int]:
        """The last stage's loss and correct count, summed onto every pipeline rank."""
        buf = np.array([self._loss, float(self._correct)], dtype=np.float64)
        self.comm.comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
        return float(buf[0]), int(round(buf[1]))

    # ------------------------------------------------------------------ transfers
    def _post_recv(self, a: Action) -> None:
        """Post the receive a compute will wait for; deferred while its shape is unknown
        (only the first transfer on a boundary)."""
        meta = self._meta_in.get(a.stage) if a.kind == RECV_F else self._meta_out.get(a.stage)
        key = Action(FORWARD if a.kind == RECV_F else BACKWARD, a.microbatch, a.stage)
        channel = (a.kind, a.stage)
        if meta is None or self._deferred.get(channel):
            # receives on a channel match in posting order: once one waits, later ones wait
            self._deferred[channel] = self._deferred.get(channel, 0) + 1
            self._recvs[key] = (None, None, None)
            return
        buf = self._take(meta)
        mbuf = self.comm.to_mpi(buf)
        src, tag = self._source(key)
        request = self.comm.comm.Irecv([byte_view(mbuf), MPI.BYTE], source=src, tag=tag)
        self._recvs[key] = (request, buf, mbuf)

    def _source(self, compute: Action) -> tuple[int, int]:
        s = compute.stage
        if compute.kind == FORWARD:
            return self.schedule.rank_of(s - 1), self._act_tag(s - 1)
        return self.schedule.rank_of(s + 1), self._grad_tag(s + 1)

    def _received(self, compute: Action):
        """Wait for the input of a compute action and return it."""
        request, buf, mbuf = self._recvs.pop(compute)
        if request is None:
            self._deferred[(RECV_F if compute.kind == FORWARD else RECV_B, compute.stage)] -= 1
            src, tag = self._source(compute)
            if compute.kind == FORWARD and compute.stage not in self._meta_in:
                self._meta_in[compute.stage] = self.comm.comm.recv(
                    source=src, tag=self._meta_tag + compute.stage - 1)
            meta = (self._meta_in if compute.kind == FORWARD else self._meta_out)[compute.stage]
            buf = self._take(meta)
            mbuf = self.comm.to_mpi(buf)
            self.comm.comm.Recv([byte_view(mbuf), MPI.BYTE], source=src, tag=tag)
        else:
            request.Wait()
        self.comm.from_mpi(mbuf, buf)
        return buf

    def _send(self, a: Action) -> None:
        s = a.stage
        if a.kind == SEND_F:
            dst, tag = self.schedule.rank_of(s + 1), self._act_tag(s)
            data = self._xp.ascontiguousarray(self._out.pop((FORWARD, a.microbatch, s)))
            meta = (data.shape, data.dtype)
            self._meta_out[s] = meta
            if s not in self._meta_sent:
                self._sends.append((self.comm.comm.isend(meta, dest=dst,
                                                         tag=self._meta_tag + s), None))
                self._meta_sent.add(s)
        else:
            dst, tag = self.schedule.rank_of(s - 1), self._grad_tag(s)
            shape, dtype = self._meta_in[s]
            data = self._xp.ascontiguousarray(self._out.pop((BACKWARD, a.microbatch, s)),
                                              dtype=dtype)
        mbuf = self.comm.to_mpi(data)
        self._sends.append((self.comm.comm.Isend([byte_view(mbuf), MPI.BYTE], dest=dst, tag=tag), data))
        self._progress()

    def _progress(self) -> None:
        """Let MPI move the pending transfers on before this rank computes for a while:
        without a progress thread, a large message advances only inside MPI calls."""
        MPI.Request.Testsome([r for r, _ in self._sends])
        self._sends = [(r, d) for r, d in self._sends if r != MPI.REQUEST_NULL]

    def _release(self, buf) -> None:
        """Mark a received buffer free; it returns to the pool at a later take, once no
        pending send reads it (identity layers send their input on)."""
        if id(buf) in self._pool.owned:
            self._releasing.append(buf)

    def _take(self, meta):
        """A receive buffer: first recycle the released ones whose readers have finished
        (tested, never waited for: a wait here could depend on a peer that waits for us)."""
        still_read = []
        for buf in self._releasing:
            readers = [k for k, (_, data) in enumerate(self._sends)
                       if data is not None and self._xp.may_share_memory(data, buf)]
            if all(self._sends[k][0].Test() for k in readers):
                for k in readers:
                    self._sends[k] = (self._sends[k][0], None)
                self._pool.give(buf)
            else:
                still_read.append(buf)
        self._releasing = still_read
        return self._pool.take(self._xp, *meta)

    # ------------------------------------------------------------------ compute
    def _input(self, a: Action):
        """What a compute action consumes: F's input activation; B's output gradient (None
        on the last stage, whose gradient the loss left in the stash)."""
        if (a.kind == FORWARD and a.stage == 0) or (a.kind == BACKWARD and a.stage == self._last):
            return self._xs[a.microbatch] if a.kind == FORWARD else None
        if self.schedule.pp == 1:
            return self._local.pop(a)
        return self._received(a)

    def _forward(self, a: Action, h) -> None:
        i, s = a.microbatch, a.stage
        stage = self.stages[s]
        rng = stage.rng_state() if self.recompute else None
        out = stage.forward(h, self._train)
        dout = None
        if s == self._last:
            loss, correct = self.loss.forward(out, self._ys[i])
            self._loss += loss
            self._correct += correct
            dout = self.loss.backward(self._scale)
        elif self.schedule.pp == 1:
            self._local[Action(FORWARD, i, s + 1)] = out
        else:
            self._out[(FORWARD, i, s)] = out
            if a in self._send_after:
                self._send(self._send_after[a])
        caches = None if self.recompute else stage.stash()
        nbytes = stash_nbytes(h, caches, dout)
        self._stash[(i, s)] = (h, caches, rng, dout, nbytes)
        self._in_flight += 1
        self._stash_bytes += nbytes
        st = self._stats
        st.microbatch_stash_bytes = max(st.microbatch_stash_bytes, nbytes)
        st.peak_in_flight = max(st.peak_in_flight, self._in_flight)
        st.peak_stash_bytes = max(st.peak_stash_bytes, self._stash_bytes)

    def _backward(self, a: Action, dout) -> None:
        i, s = a.microbatch, a.stage
        stage = self.stages[s]
        h, caches, rng, loss_grad, nbytes = self._stash.pop((i, s))
        if dout is None:
            dout = loss_grad
        if self.recompute:
            now = stage.rng_state()
            stage.set_rng_state(rng)
            stage.forward(h, self._train)
            stage.set_rng_state(now)
        else:
            stage.unstash(caches)
        dx = stage.backward(dout)
        self._in_flight -= 1
        self._stash_bytes -= nbytes
        if s > 0:
            if self.schedule.pp == 1:
                self._local[Action(BACKWARD, i, s - 1)] = dx
            else:
                self._out[(BACKWARD, i, s)] = dx
                if a in self._send_after:
                    self._send(self._send_after[a])
        self._release(h)
        self._release(dout)
