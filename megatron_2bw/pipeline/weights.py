"""A stage's weights as flat buffers: one per version slot, plus fp32 master weights and gradients.

Layout of every flat buffer (same offsets everywhere), so that the weight-decay range, the range
of parameters replicated across tensor ranks and the range of sequence-parallel parameters are
contiguous:
    [tied | decay, tensor-split | decay, replicated | no decay, replicated, sequence-parallel |
     no decay, replicated | no decay, split]
    + TAIL trailing elements of gradient buffers: [loss, *flags.FLAGS]
Sequence-parallel parameters (`param.sequence_parallel`: norms and row-parallel biases that see
only this tensor rank's part of the sequence under --sequence-parallel) get a partial gradient on
each tensor rank; the engine all-reduces `sequence_parallel_range` over the tensor group once per
batch.
The tail of a gradient buffer carries the batch's loss and the control flags (flags.py) through
the same reductions (data-parallel average, then model-parallel sum), so no extra collective is
needed to give every rank the loss or to agree on stopping.

Decoupled lr (--decoupled-lr, optim/lr.py): `decoupled` lists the (lo, hi) ranges of the
parameters a model marks `is_embedding_or_output_parameter` (Megatron's attribute: the input word
embedding and the output layer, so both copies of a tied word embedding), adjacent ones merged.
They are matrices at the edges of the decayed range: the tied weight first, an untied embedding
first and an untied output layer last of the split matrices (the order of `named_parameters`), so
there are at most two ranges; the optimizer steps them at their own lr (optim/segments.py).

Version slots: 2BW keeps exactly two (`slots[0]`, `slots[1]`); gpipe/flush keep one. Each slot has
its own replica of the stage module whose parameters are views into that slot (`modules[k]`), so
switching versions is choosing a module: nothing is copied per microbatch. The two replicas share
every non-parameter object; building the second one copies no weights.

Master: bf16/fp16 runs keep the fp32 weights the optimizer steps in `master` and copy them into a
slot after each step. fp32 runs have none: the optimizer steps from one slot into the other,
unless the slots hold something other than the weights (`separate_master=True`: 2BW's `predict`
compensation writes a prediction there, pipeline/compensation.py); then `master` is one more
stage-sized fp32 buffer holding the real weights, the only extra memory of that method.

Gradients: fp32 runs accumulate straight into `grads[k]` (the parameters' `.grad` are views of
it). bf16/fp16 runs (`grad_accumulation`, --grad-accumulation): "fp32" (the default, Megatron's
`main_grad`): a parameter's `.grad` is None between backwards; autograd hands each parameter its
low-precision gradient as it computes it, and a post-accumulate hook of the parameter adds it into
its view of the fp32 `grads[k]` and drops it, so a low-precision gradient lives only while its
parameter's hook runs (no stage-sized low-precision buffer). "buffer": backward accumulates one
microbatch in the low-precision `model_grad` buffer (the parameters' `.grad` are views of it) and
the engine folds it into the fp32 `grads[k]` after each backward (one flat add, no per-parameter
work, 2 bytes per parameter more). Both add the same low-precision gradient into fp32: the
results are bitwise equal.
`grad_buffers` g (the schedule kind's, `kinds.py`): the fp32 buffers behind `grads` (indexed by
slot). g = num_slots (the default): one per slot, and `losses[k]` is the loss element of
`grads[k]`'s tail. g = 1 under 2BW (`--2bw-grad-buffers 1`): `grads[0]` and `grads[1]` are one
buffer (both modules' `.grad` views point into it in fp32 runs) that S(t) zeroes before the
stage's first backward of batch t+1, while batch t+1's forwards on the last stage may already
have added their losses: so each slot keeps its loss apart (`losses[k]`, one fp32 element) and R
copies it into the buffer's tail and zeroes it (`take_loss`).

Distributed optimizer (`shard_count` w > 1, --use-distributed-optimizer): the flat layout is cut
into regions padded to multiples of w (`shard_layout.py`: the tied weight is its own region on the
stages that hold one copy of it, the rest is cut into the data-parallel reduction's buckets; the
same regions, unpadded, without the distributed optimizer) and `pieces` are this data-parallel rank's parts of them. The
weight slots, `grads` and `model_grad` keep the whole padded stage (forward and backward need
every weight, and every microbatch's gradient); `master` (bf16/fp16, or `separate_master`)
holds only this rank's shard: the pieces' fp32 weights back to back. Padding elements are zero in
every buffer and stay zero (their gradient is zero). `numel` is the padded length; `pack` /
`unpack_into` convert to and from the unpadded concatenation of the parameters, the layout of
checkpoints.
"""
from __future__ import annotations

import copy

import torch
from torch import nn

from megatron_2bw.config.choices import GRAD_ACCUMULATIONS
from megatron_2bw.config.control_flags import TAIL  # TAIL: loss, then flags
from megatron_2bw.optim.shard_layout import ShardLayout, region_lengths


def _group(p: nn.Parameter, tied: dict) -> int:
    """Position class in the flat layout (see the module docstring)."""
    if any(p is q for q in tied.values()):
        return 0
    split = getattr(p, "partition_dim", None) is not None
    if getattr(p, "sequence_parallel", False):
        if split or p.ndim >= 2:
            raise ValueError("a sequence-parallel parameter must be a replicated vector (a norm "
                             f"or a row-parallel bias), got shape {tuple(p.shape)}")
        return 3
    if p.ndim >= 2:
        return 1 if split else 2
    return 5 if split else 4


def _merged(ranges: list[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(ranges):
        if out and out[-1][1] == lo:
            out[-1] = (out[-1][0], hi)
        else:
            out.append((lo, hi))
    return tuple(out)


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _into_fp32(main: torch.Tensor):
    """The post-accumulate hook of a bf16/fp16 parameter: its gradient into its fp32 view, then
    dropped (autograd gives the next backward a fresh one)."""
    def hook(p: nn.Parameter) -> None:
        main.add_(p.grad)
        p.grad = None
    return hook


class VersionedWeights:
    def __init__(self, module: nn.Module, num_slots: int, dtype: str, device,
                 tied: dict[str, nn.Parameter] | None = None, shard_count: int = 1,
                 shard_rank: int = 0, split_tied: bool = False, separate_master: bool = False,
                 grad_buffers: int | None = None, grad_accumulation: str = "fp32",
                 bucket: int | None = None):
        """`shard_count`/`shard_rank`: the data-parallel size and rank of a distributed optimizer
        (1/0: none); `split_tied`: the tied weight is a region of its own (a stage holding one
        copy of a cross-stage tied weight, see shards.py); `separate_master`: keep an fp32 master
        in fp32 runs too (a 2BW compensation whose slots hold predictions, compensation.py);
        `grad_buffers`: fp32 gradient buffers (None: one per slot; see the module docstring);
        `grad_accumulation`: "fp32" or "buffer", how bf16/fp16 gradients reach them (ditto);
        `bucket`: elements per data-parallel reduction bucket (None: one bucket; shard_layout.py
        `region_lengths`)."""
        if grad_accumulation not in GRAD_ACCUMULATIONS:
            raise ValueError(f"grad_accumulation must be one of {GRAD_ACCUMULATIONS}, got "
                             f"{grad_accumulation!r}")
        self.dtype = DTYPES[dtype]
        self.device = torch.device(device)
        self.num_slots = num_slots
        params, names = self._ordered_params(module, tied or {})
        self.names = names
        self.shapes = [p.shape for p in params]
        self.partition_dims = [getattr(p, "partition_dim", None) for p in params]
        self.sequence_parallel = [getattr(p, "sequence_parallel", False) for p in params]
        self.decoupled_flags = [getattr(p, "is_embedding_or_output_parameter", False)
                                for p in params]
        groups = [_group(p, tied or {}) for p in params]
        real = [sum(p.numel() for p, g in zip(params, groups) if g <= k) for k in range(6)]
        tied_params = sum(g == 0 for g in groups) if split_tied else 0
        lengths = region_lengths([p.numel() for p in params], tied_params, bucket)
        self.layout = ShardLayout(lengths, shard_count)
        self.sharded, self.shard_rank = shard_count > 1, shard_rank
        self.pieces = self.layout.pieces(shard_rank)
        self.offsets, n = [], 0
        for p in params:
            self.offsets.append(self.layout.padded_offset(n))
            n += p.numel()
        self.numel = self.layout.numel  # padded (= the parameter count when not sharded)
        ends = [self.layout.padded_offset(e) if e < n else self.numel for e in real]
        self.tied_end, self.decay_end = ends[0], ends[2]
        self.replicated = (ends[1], ends[4])  # identical on every tensor rank
        self.sequence_parallel_range = (ends[2], ends[3])
        self.decoupled = _merged([(o, o + p.numel()) for p, o in zip(params, self.offsets)
                                  if getattr(p, "is_embedding_or_output_parameter", False)])

        init = torch.zeros(self.numel, device=self.device)
        if params:
            self.unpack_into(init, torch.cat([p.detach().reshape(-1).float() for p in params]))
        mixed = self.dtype != torch.float32
        keep = mixed or separate_master
        if keep and self.sharded:
            self.master = torch.cat([init[p.lo:p.hi] for p in self.pieces])
        else:
            self.master = init.clone() if keep else None
        self.slots = [init.to(self.dtype).clone() for _ in range(num_slots)]
        g = num_slots if grad_buffers is None else grad_buffers
        if g not in (1, num_slots):
            raise ValueError(f"grad_buffers must be 1 or the {num_slots} version slots, got {g}")
        self.grad_buffers = g
        buffers = [torch.zeros(self.numel + TAIL, dtype=torch.float32, device=self.device)
                   for _ in range(g)]
        self.grads = [buffers[k % g] for k in range(num_slots)]
        self.separate_losses = g < num_slots
        self.losses = [torch.zeros(1, dtype=torch.float32, device=self.device)
                       if self.separate_losses else b[self.numel:self.numel + 1]
                       for b in self.grads]
        buffered = mixed and grad_accumulation == "buffer"
        self.model_grad = torch.zeros(self.numel, dtype=self.dtype, device=self.device) \
            if buffered else None
        hooked = mixed and not buffered  # fp32 accumulation through per-parameter hooks

        module.to(self.device)
        grad_flats = [self.model_grad if buffered else (None if hooked else self.grads[k])
                      for k in range(num_slots)]
        views = [[self._view_param(self.slots[k], grad_flats[k], i)
                  for i in range(len(params))] for k in range(num_slots)]
        self._install(module, params, views[0])
        self.params = views  # per slot: its module's parameters, in layout order
        self.modules = [module] + [copy.deepcopy(module, {id(a): b for a, b in zip(views[0], v)})
                                   for v in views[1:]]
        if hooked:
            for k in range(num_slots):
                for i, p in enumerate(views[k]):
                    o, shape = self.offsets[i], self.shapes[i]
                    main = self.grads[k][o:o + shape.numel()].view(shape)
                    p.register_post_accumulate_grad_hook(_into_fp32(main))

    # -- construction helpers ---------------------------------------------------------------------
    @staticmethod
    def _ordered_params(module: nn.Module, tied: dict) -> tuple[list, list]:
        named = list(module.named_parameters())  # unique: a shared parameter appears once
        named.sort(key=lambda item: _group(item[1], tied))  # stable within each group
        return [p for _, p in named], [n for n, _ in named]

    def _view_param(self, flat: torch.Tensor, grad_flat, i: int) -> nn.Parameter:
        o, shape = self.offsets[i], self.shapes[i]
        n = shape.numel()
        p = nn.Parameter(flat[o:o + n].view(shape))
        if grad_flat is not None:  # None: the fp32 hook's parameters keep no .grad
            p.grad = grad_flat[o:o + n].view(shape)
        p.partition_dim = self.partition_dims[i]
        p.sequence_parallel = self.sequence_parallel[i]
        p.tensor_model_parallel = p.partition_dim is not None
        p.is_embedding_or_output_parameter = self.decoupled_flags[i]
        return p

    @staticmethod
    def _install(module: nn.Module, old: list, new: list) -> None:
        by_id = {id(p): q for p, q in zip(old, new)}
        for sub in module.modules():
            for name, p in list(sub._parameters.items()):
                if p is not None:
                    sub._parameters[name] = by_id[id(p)]
        if isinstance(getattr(module, "tied", None), dict):
            module.tied = {k: by_id[id(p)] for k, p in module.tied.items()}

    # -- views ------------------------------------------------------------------------------------
    def fp32_weights(self, slot: int | None = None) -> torch.Tensor:
        """The newest fp32 weights of the whole (padded) stage: the master, or the given slot in
        fp32 runs without one. Sharded runs hold no whole fp32 master: the slot, in fp32."""
        if self.master is not None and not self.sharded:
            return self.master
        flat = self.slots[slot if slot is not None else 0]
        return flat if flat.dtype == torch.float32 else flat.float()

    def master_into(self, slot: int) -> None:
        """Copy the master into `slot` (sharded: into this rank's pieces of it; the caller
        all-gathers the rest)."""
        if not self.sharded:
            self.slots[slot].copy_(self.master)
            return
        for p, m in zip(self.pieces, self.master_pieces()):
            self.slots[slot][p.lo:p.hi].copy_(m)

    def master_pieces(self) -> list[torch.Tensor]:
        """Views of `master` for every piece of this rank's shard (sharded bf16/fp16 runs)."""
        out, o = [], 0
        for p in self.pieces:
            out.append(self.master[o:o + p.size])
            o += p.size
        return out

    def pack(self, flat: torch.Tensor) -> torch.Tensor:
        """The parameters of a padded flat buffer, back to back (a view when nothing is padded)."""
        ranges = self.layout.real_ranges()
        if len(ranges) == 1:
            return flat[ranges[0][0]:ranges[0][1]]
        return torch.cat([flat[lo:hi] for lo, hi in ranges])

    def unpack_into(self, flat: torch.Tensor, packed: torch.Tensor) -> None:
        """Copy `packed` (the parameters back to back) into the padded `flat`."""
        o = 0
        for lo, hi in self.layout.real_ranges():
            flat[lo:hi].copy_(packed[o:o + hi - lo])
            o += hi - lo

    def named_tensors(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        return {name: flat[o:o + s.numel()].view(s)
                for name, o, s in zip(self.names, self.offsets, self.shapes)}

    def fold_model_grad(self, slot: int) -> None:
        """bf16/fp16: add this microbatch's low-precision gradient into the fp32 accumulator."""
        if self.model_grad is not None:
            self.grads[slot][:self.numel].add_(self.model_grad)
            self.model_grad.zero_()

    def held_grads(self) -> list[torch.Tensor]:
        """The distinct fp32 gradient tensors this stage holds (buffers, then the separate
        per-slot loss elements of a one-buffer 2BW): what the memory model counts."""
        unique = list({id(b): b for b in self.grads}.values())
        return unique + (self.losses if self.separate_losses else [])

    def zero_grads(self) -> None:
        for t in self.held_grads():
            t.zero_()

    def take_loss(self, slot: int) -> None:
        """R: a separate per-slot loss into the tail of the slot's buffer, then zero it (one
        buffer per slot: the loss is already there)."""
        if self.separate_losses:
            self.grads[slot][self.numel:self.numel + 1].copy_(self.losses[slot])
            self.losses[slot].zero_()
