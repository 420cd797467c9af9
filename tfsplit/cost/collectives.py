"""Alpha-beta times of collectives and Send/Recv over devices of a ClusterSpec.

alpha is the per-step latency and 1/beta the bandwidth of the slowest link the
group crosses (ClusterSpec.group_link). With n members and M bytes:

  all-reduce (ring)   2(n-1) alpha + 2(n-1)/n M / B   M: the tensor reduced
  all-gather          (n-1) alpha  +  (n-1)/n M / B   M: the gathered output
  reduce-scatter      (n-1) alpha  +  (n-1)/n M / B   M: the full input
  all-to-all          (n-1) alpha  +  (n-1)/n M / B   M: what one member holds
  broadcast           (n-1) alpha  +        M / B     (pipelined ring)
  send/recv                 alpha  +        M / B

These are the bandwidth-optimal ring algorithms NCCL and TF's collective ops
use for large tensors (Thakur et al. 2005; Patarasuk & Yuan 2009). All-to-all
across hosts is not ring-shaped: the bytes bound for other hosts go out through
the members' own share of the network, so it is modelled per host.
"""
import collections

from tfsplit.errors import TfsplitError

# TF op -> collective kind, for the graph-to-task-DAG conversion.
OP_COLLECTIVE = {
    "CollectiveReduce": "all_reduce",
    "CollectiveReduceV2": "all_reduce",
    "CollectiveReduceV3": "all_reduce",
    "NcclAllReduce": "all_reduce",
    "CollectiveGather": "all_gather",
    "CollectiveGatherV2": "all_gather",
    "CollectiveReduceScatterV2": "reduce_scatter",
    "CollectiveAllToAllV2": "all_to_all",
    "CollectiveAllToAllV3": "all_to_all",
    "CollectiveBcastSend": "broadcast",
    "CollectiveBcastSendV2": "broadcast",
    "_Send": "send_recv",
    "_HostSend": "send_recv",
    "_Recv": "send_recv",
    "_HostRecv": "send_recv",
}


def ring_all_reduce(n, nbytes, link):
  if n <= 1:
    return 0.0
  return 2 * (n - 1) * link.latency + 2 * (n - 1) / n * nbytes / link.bandwidth


def ring_all_gather(n, nbytes, link):
  if n <= 1:
    return 0.0
  return (n - 1) * link.latency + (n - 1) / n * nbytes / link.bandwidth


ring_reduce_scatter = ring_all_gather  # the same steps, reducing instead


def pairwise_all_to_all(n, nbytes, link):
  return ring_all_gather(n, nbytes, link)


def pipelined_broadcast(n, nbytes, link):
  if n <= 1:
    return 0.0
  return (n - 1) * link.latency + nbytes / link.bandwidth


def all_reduce_time(cluster, group, nbytes):
  return ring_all_reduce(len(set(group)), nbytes, cluster.group_link(group))


def all_gather_time(cluster, group, nbytes):
  return ring_all_gather(len(set(group)), nbytes, cluster.group_link(group))


def reduce_scatter_time(cluster, group, nbytes):
  return ring_reduce_scatter(len(set(group)), nbytes, cluster.group_link(group))


def broadcast_time(cluster, group, nbytes):
  return pipelined_broadcast(len(set(group)), nbytes, cluster.group_link(group))


def send_recv_time(cluster, src, dst, nbytes):
  if src == dst:
    return 0.0
  return cluster.link(src, dst).transfer_time(nbytes)


def all_to_all_time(cluster, group, nbytes):
  """Each member sends nbytes/n to every other member.

  Within a host it is the pairwise formula over the intra-host link. Across
  hosts each member pushes the (n - k)/n M bytes meant for other hosts through
  its share of its host's network while the (k - 1)/n M for host peers go over
  the intra-host link; the slowest host sets the time.
  """
  members = sorted(set(group))
  n = len(members)
  if n <= 1:
    return 0.0
  by_host = collections.Counter(cluster.devices[i].host for i in members)
  if len(by_host) == 1:
    return pairwise_all_to_all(n, nbytes, cluster.group_link(members))
  latency = cluster.group_link(members).latency
  slowest = 0.0
  for host_name, k in by_host.items():
    host = cluster.hosts[host_name]
    share = cluster.network_share(host_name)
    t = (n - k) / n * nbytes / share
    if k > 1:
      t = max(t, (k - 1) / n * nbytes / host.intra_host_link.bandwidth)
    slowest = max(slowest, t)
  return (n - 1) * latency + slowest


_BY_KIND = {
    "all_reduce": all_reduce_time,
    "all_gather": all_gather_time,
    "reduce_scatter": reduce_scatter_time,
    "all_to_all": all_to_all_time,
    "broadcast": broadcast_time,
}


def collective_time(kind, cluster, group, nbytes):
  """Seconds for collective `kind` (a value of OP_COLLECTIVE) over `group`.

  For 'send_recv', `group` is (src, dst).
  """
  if kind == "send_recv":
    src, dst = group
    return send_recv_time(cluster, src, dst, nbytes)
  if kind not in _BY_KIND:
    raise TfsplitError(f"unknown collective '{kind}'; choose one of: "
                       f"{', '.join(sorted(_BY_KIND) + ['send_recv'])}")
  return _BY_KIND[kind](cluster, group, nbytes)
