"""The machine the planner plans for: nodes, accelerators per node, memory, links.

Sources, later ones winning field by field: built-in defaults (an A100-80GB / HDR-InfiniBand
cluster node), what the environment reveals (SLURM variables, visible CUDA devices), a JSON file
(`Topology.to_json` writes one), explicit flags.

Bandwidths are in Gbit/s per accelerator and direction (NVLink3: 2400, HDR InfiniBand: 200),
latencies in microseconds, memory in GB (2^30 bytes). Shared links: `nics_per_node` NICs of
`nic_bandwidth_gbps` each carry all of a node's inter-node traffic, so k concurrent flows leaving
one node get min(inter_node_bandwidth_gbps, nics x nic_bandwidth / k) each (planner/placement.py
counts the flows a layout runs at once). The default, 0 NICs, keeps the old meaning: every
accelerator has `inter_node_bandwidth_gbps` to itself. The paper's AWS p3.16xlarge is
`--inter-node-bandwidth-gbps 25 --nics-per-node 1 --nic-bandwidth-gbps 25` (one 25 Gbit/s NIC
shared by 8 V100s). `usable_memory_gb` leaves
`memory_reserve_fraction` for the runtime (CUDA context, allocator fragmentation, workspaces).
Ranks are placed on nodes in order: rank r lives on node r // gpus_per_node.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass, fields

from megatron_2bw.config import ConfigError
from megatron_2bw.config.input_files import file_error, json_kind, read_json
from megatron_2bw.config.numbers import is_finite
from megatron_2bw.fs import atomic_write_text

GB = float(2 ** 30)


class PlanError(ConfigError):
    """Bad planner input, or nothing fits. One line: what is wrong and how to fix it."""


@dataclass
class Topology:
    num_nodes: int = 1
    gpus_per_node: int = 8
    gpu_memory_gb: float = 80.0
    intra_node_bandwidth_gbps: float = 2400.0
    inter_node_bandwidth_gbps: float = 200.0
    intra_node_latency_us: float = 5.0
    inter_node_latency_us: float = 10.0
    memory_reserve_fraction: float = 0.1
    nics_per_node: int = 0                 # 0: no sharing (inter_node_bandwidth per accelerator)
    nic_bandwidth_gbps: float = 0.0        # per NIC and direction (used when nics_per_node > 0)

    # -- derived ----------------------------------------------------------------------------------
    @property
    def num_gpus(self) -> int:
        return self.num_nodes * self.gpus_per_node

    @property
    def usable_memory_gb(self) -> float:
        return self.gpu_memory_gb * (1.0 - self.memory_reserve_fraction)

    def node_of(self, rank: int) -> int:
        return rank // self.gpus_per_node

    def link(self, inter_node: bool, flows: int = 1) -> tuple[float, float]:
        """(bandwidth in bytes/s, latency in s) of an intra- or inter-node link; `flows`: how many
        transfers leave the node at once, sharing its NICs (when it has any)."""
        if inter_node:
            gbps = self.inter_node_bandwidth_gbps
            if self.nics_per_node:
                gbps = min(gbps, self.nics_per_node * self.nic_bandwidth_gbps / max(flows, 1))
            return gbps * 1e9 / 8, self.inter_node_latency_us * 1e-6
        return self.intra_node_bandwidth_gbps * 1e9 / 8, self.intra_node_latency_us * 1e-6

    def transfer_time(self, nbytes: float, inter_node: bool, flows: int = 1) -> float:
        bw, lat = self.link(inter_node, flows)
        return lat + nbytes / bw

    def spans_nodes(self, ranks) -> bool:
        return len({self.node_of(r) for r in ranks}) > 1

    def ring_time(self, nbytes: float, n: int, inter_node: bool, flows: int = 1) -> float:
        """Ring all-reduce of `nbytes` over n ranks: 2(n-1)/n of the data over the slowest link
        (`flows` rings crossing one node at once share its NICs)."""
        if n <= 1 or nbytes <= 0:
            return 0.0
        bw, lat = self.link(inter_node, flows)
        return 2.0 * (n - 1) / n * nbytes / bw + 2.0 * (n - 1) * lat

    def allreduce_time(self, nbytes: float, ranks: list[int]) -> float:
        return self.ring_time(nbytes, len(ranks), self.spans_nodes(ranks))

    # -- checks and (de)serialization -------------------------------------------------------------
    def validate(self) -> "Topology":
        for f in fields(self):
            value = getattr(self, f.name)
            if not is_finite(value):  # a JSON string, bool, null, NaN or Infinity
                raise PlanError(f"--{f.name.replace('_', '-')} must be a finite number, got "
                                f"{value!r}")
        for name, value in (("num_nodes", self.num_nodes), ("gpus_per_node", self.gpus_per_node)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise PlanError(f"--{name.replace('_', '-')} must be an integer >= 1, "
                                f"got {value!r}")
        for name in ("gpu_memory_gb", "intra_node_bandwidth_gbps", "inter_node_bandwidth_gbps"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not value > 0:
                raise PlanError(f"--{name.replace('_', '-')} must be > 0, got {value!r}: give the "
                                "accelerator's real value")
        if not isinstance(self.nics_per_node, int) or isinstance(self.nics_per_node, bool) or \
                self.nics_per_node < 0:
            raise PlanError(f"--nics-per-node must be an integer >= 0 (0: no shared NICs), got "
                            f"{self.nics_per_node!r}")
        if self.nics_per_node and not (isinstance(self.nic_bandwidth_gbps, (int, float))
                                       and self.nic_bandwidth_gbps > 0):
            raise PlanError(f"--nic-bandwidth-gbps must be > 0 with --nics-per-node "
                            f"{self.nics_per_node}, got {self.nic_bandwidth_gbps!r}: give each "
                            "NIC's Gbit/s")
        if not self.nics_per_node and self.nic_bandwidth_gbps:
            raise PlanError(f"--nic-bandwidth-gbps {self.nic_bandwidth_gbps:g} needs "
                            "--nics-per-node N (the NICs a node's inter-node traffic shares); "
                            "without it each accelerator gets --inter-node-bandwidth-gbps")
        for name in ("intra_node_latency_us", "inter_node_latency_us"):
            if getattr(self, name) < 0:
                raise PlanError(f"--{name.replace('_', '-')} must be >= 0, "
                                f"got {getattr(self, name)}")
        if not 0 <= self.memory_reserve_fraction < 1:
            raise PlanError(f"--memory-reserve-fraction must be in [0, 1), got "
                            f"{self.memory_reserve_fraction}")
        return self

    def to_json(self, path: str | None = None) -> str:
        text = json.dumps(asdict(self), indent=2)
        if path:
            atomic_write_text(path, text + "\n")
        return text

    @classmethod
    def from_dict(cls, data: dict, source: str = "topology") -> "Topology":
        return cls(**_checked_fields(data, source)).validate()


_FIELDS = {f.name: f.type for f in fields(Topology)}


def _checked_fields(data: dict, source: str) -> dict:
    if not isinstance(data, dict):
        raise PlanError(f"{source}: expected a JSON object with keys {', '.join(_FIELDS)}")
    unknown = sorted(set(data) - set(_FIELDS))
    if unknown:
        raise PlanError(f"{source}: unknown key {unknown[0]!r}; valid keys: {', '.join(_FIELDS)}")
    return dict(data)


def load_topology_file(path: str) -> dict:
    fix = f"give a topology JSON: an object with some of {', '.join(_FIELDS)}"
    data = _checked_fields(read_json(path, fix, None, PlanError), path)
    for key, value in data.items():
        if not is_finite(value):
            raise file_error(path, f"{key} is {json_kind(value)}, not a finite number", fix,
                             PlanError)
    return data


def _first_int(text: str | None) -> int | None:
    """'4', 'gpu:4', 'a100:4(x2)', '4(x2)' -> 4."""
    if not text:
        return None
    nums = re.findall(r"(?<![x\d])(\d+)", text.split(",")[0].split("(")[0])
    return int(nums[-1]) if nums else None


def detect_from_env(env=None) -> dict:
    """Fields revealed by SLURM variables and the visible CUDA devices (empty when none)."""
    env = os.environ if env is None else env
    found = {}
    nodes = _first_int(env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES"))
    if nodes:
        found["num_nodes"] = nodes
    gpn = (_first_int(env.get("SLURM_GPUS_ON_NODE")) or _first_int(env.get("SLURM_GPUS_PER_NODE"))
           or _first_int(env.get("SLURM_NTASKS_PER_NODE")))
    if gpn is None and env.get("CUDA_VISIBLE_DEVICES"):
        gpn = len([d for d in env["CUDA_VISIBLE_DEVICES"].split(",") if d.strip()])
    # torch (seconds to import) only where an NVIDIA driver is loaded: nothing to find elsewhere
    cuda = env is os.environ and (os.path.exists("/proc/driver/nvidia/version")
                                  or os.path.exists("/dev/nvidiactl"))
    if gpn is None and cuda:
        try:
            import torch
            if torch.cuda.is_available():
                gpn = torch.cuda.device_count()
        except Exception:  # noqa: BLE001 - detection is best effort
            gpn = None
    if gpn:
        found["gpus_per_node"] = gpn
    if cuda:
        try:
            import torch
            if torch.cuda.is_available():
                found["gpu_memory_gb"] = torch.cuda.get_device_properties(0).total_memory / GB
        except Exception:  # noqa: BLE001
            pass
    return found


def resolve_topology(flags: dict | None = None, path: str | None = None, env=None,
                     num_gpus: int | None = None) -> Topology:
    """Defaults < environment < file < flags (None flags are ignored). `num_gpus`, when given,
    is the total: it must be a multiple of gpus_per_node and sets the number of nodes."""
    merged = asdict(Topology())
    explicit = set()
    for layer in (detect_from_env(env), load_topology_file(path) if path else {},
                  {k: v for k, v in (flags or {}).items() if v is not None}):
        unknown = sorted(set(layer) - set(_FIELDS))
        if unknown:
            raise PlanError(f"unknown topology field {unknown[0]!r}")
        merged.update(layer)
        explicit |= set(layer)
    if num_gpus is not None:
        if not isinstance(num_gpus, int) or num_gpus < 1:
            raise PlanError(f"--num-gpus must be an integer >= 1, got {num_gpus!r}")
        gpn = merged["gpus_per_node"]
        if "gpus_per_node" not in explicit:
            gpn = merged["gpus_per_node"] = min(num_gpus, gpn)
        if gpn < 1:
            raise PlanError(f"--gpus-per-node must be an integer >= 1, got {gpn!r}")
        if num_gpus % gpn:
            raise PlanError(f"--num-gpus {num_gpus} is not divisible by --gpus-per-node {gpn}: "
                            f"use a multiple of {gpn} GPUs or fix --gpus-per-node")
        if "num_nodes" in explicit and merged["num_nodes"] * gpn != num_gpus:
            raise PlanError(f"--num-nodes {merged['num_nodes']} x --gpus-per-node {gpn} != "
                            f"--num-gpus {num_gpus}: give two of the three")
        merged["num_nodes"] = num_gpus // gpn
    return Topology.from_dict(merged)


__all__ = ["GB", "PlanError", "Topology", "resolve_topology", "detect_from_env",
           "load_topology_file"]
