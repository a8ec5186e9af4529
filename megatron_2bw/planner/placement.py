"""Which links a layout's groups use, and how many flows share a node's NICs at once.

`placement(layout, topology)` -> (inter-node flag per p2p boundary, per stage whether its
data-parallel group spans nodes, whether the tied group does, whether the model-parallel (one rank
per stage) group does, (p2p flows, data-parallel flows)).

The flows count what runs at the same time through one node's NICs (`Topology.nics_per_node`,
`nic_bandwidth_gbps`): in the steady state every stage boundary carries a transfer, so the p2p
count is the most ranks of one node that send across nodes over all boundaries (every replica,
every tensor rank); the gradient all-reduces of all stages meet at the end of a batch, so the
data-parallel count is the most node-spanning data-parallel groups (stage x tensor rank) that
have a member on one node (a ring leaves a node once per direction). On a topology without NICs
(`nics_per_node` 0, the default) the counts change nothing: each accelerator keeps
`inter_node_bandwidth_gbps` to itself.
"""
from __future__ import annotations

from megatron_2bw.schedule.comm_layout import rank_of  # the grid's arithmetic, without torch


def placement(layout, topology) -> tuple:
    t, d, w, order = layout.tensor, layout.pipeline, layout.data, layout.rank_order
    node = topology.node_of
    ranks = [[[rank_of(i, s, j, t, d, w, order) for j in range(w)] for s in range(d)]
             for i in range(t)]
    nodes = [[node(r) for r in row] for row in ranks[0]]
    inter = [any(a != b for a, b in zip(nodes[c], nodes[c + 1])) for c in range(d - 1)]
    dp = [len(set(row)) > 1 for row in nodes]
    tied = len(set(nodes[0]) | set(nodes[-1])) > 1
    mp = len({row[0] for row in nodes}) > 1
    if not topology.nics_per_node:
        return inter, dp, tied, mp, (1, 1)
    send, groups = {}, {}
    for i in range(t):
        for s in range(d):
            row = ranks[i][s]
            for c in (s,) if s < d - 1 else ():
                for a, b in zip(row, ranks[i][c + 1]):
                    if node(a) != node(b):
                        send[node(a)] = send.get(node(a), 0) + 1
            members = {node(r) for r in row}
            if len(members) > 1:
                for x in members:
                    groups[x] = groups.get(x, 0) + 1
    return inter, dp, tied, mp, (max(send.values(), default=1), max(groups.values(), default=1))


__all__ = ["placement"]
