"""The planner's entry points: the cluster and per-device memory a plan is
made for (cluster_for, local_cluster, memory_cap), the plan of a layer
profile or of a training-step GraphDef (plan_profile, profile_graph,
plan_graph), and `resolve`, which turns what split() and the commands are
given (plan='auto', a plan file, a JSON dict or a Plan) into a Plan checked
against the graph's layers and the devices at hand. They hold no search of
their own: profile.py, search.py and plan.py do the work.
"""
from tfsplit.errors import PlanError
from tfsplit.plan.plan import Plan, read
from tfsplit.plan.search import DEFAULT_RESERVE, Planner, no_plan_message

AUTO = "auto"
DEFAULT_CLUSTER = "cpu-host"


def cluster_for(cluster, devices):
  """The ClusterSpec of `devices` devices: a preset name (default cpu-host), a
  spec JSON file (with at least that many devices) or a ClusterSpec."""
  from tfsplit.cost import cluster as cluster_lib  # pylint: disable=import-outside-toplevel
  if isinstance(cluster, cluster_lib.ClusterSpec):
    if cluster.num_devices < devices:
      raise PlanError(f"cluster '{cluster.name}' has {cluster.num_devices} devices, too few "
                      f"for {devices}")
    return cluster
  return cluster_lib.for_graph(cluster or DEFAULT_CLUSTER, devices)


def local_cluster(devices):
  """The ClusterSpec of this process's `devices` devices: one host of the
  default preset holding them all. Logical devices of one machine share its
  memory and talk over its memory bus, so tensor parallelism among them is
  as cheap as inside any host (the cpu-host preset alone is one device per
  server, over Ethernet: it never tries tp)."""
  from tfsplit.cost import cluster as cluster_lib  # pylint: disable=import-outside-toplevel
  return cluster_lib.from_preset(DEFAULT_CLUSTER, devices, devices_per_host=devices)


def memory_cap(device_memory, cluster):
  """Bytes per device: a size ('16GB', bytes) or a preset name; default: the
  smallest device memory of `cluster`."""
  if device_memory is None:
    return min(d.memory_bytes for d in cluster.devices)
  if isinstance(device_memory, (int, float)) and not isinstance(device_memory, bool):
    if not device_memory > 0:
      raise PlanError(f"device memory must be a positive number of bytes, got {device_memory}")
    return int(device_memory)
  from tfsplit.cost import cluster as cluster_lib  # pylint: disable=import-outside-toplevel
  sizes = cluster_lib.device_memory_sizes(device_memory)
  if len(sizes) != 1:
    raise PlanError(f"give one device memory to plan for, got '{device_memory}'")
  return sizes[0]


def check_devices(devices):
  if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
    raise PlanError(f"too few devices: planning needs at least 1, got {devices!r}")


def plan_profile(profile, devices, device_memory=None, cluster=None, top=5,
                 progress=None, max_tp=None, graph=None, memory_reserve=DEFAULT_RESERVE,
                 schedules=None):
  """(Plan, SearchResult) for a ModelProfile; PlanError if nothing fits.
  memory_reserve: the fraction of device memory plans leave free;
  schedules: the pipeline schedules plans may use (default: all)."""
  check_devices(devices)
  spec = cluster_for(cluster, devices)
  cap = memory_cap(device_memory, spec)
  planner = Planner(profile, spec, devices, cap, max_tp=max_tp, reserve=memory_reserve,
                    schedules=schedules)
  result = planner.search(top=top, progress=progress)
  if result.best is None:
    raise PlanError(no_plan_message(result, graph or profile.source or "the model"))
  return Plan.from_estimate(result.best, profile, cluster=spec.name, device_memory=cap,
                            graph=graph, runners_up=result.ranked[1:],
                            memory_reserve=memory_reserve), result


def profile_graph(graph_def, devices, cluster=None, calibration=None, source=None,
                  analysis=None):
  """The ModelProfile of a training-step GraphDef on `cluster` (see
  plan_profile); `analysis`: graph_def's Analysis, if the caller has one."""
  from tfsplit.cost import op_cost  # pylint: disable=import-outside-toplevel
  from tfsplit.plan import profile as profile_lib  # pylint: disable=import-outside-toplevel
  check_devices(devices)
  spec = cluster_for(cluster, devices)
  table = op_cost.CostTable.load(calibration) if calibration else None
  model = op_cost.CostModel(spec, table=table)
  if analysis is not None:
    return profile_lib.from_analysis(analysis, model, source)
  return profile_lib.from_graph(graph_def, model, source)


def plan_graph(graph_def, devices, device_memory=None, cluster=None, calibration=None,
               top=5, progress=None, max_tp=None, source=None,
               memory_reserve=DEFAULT_RESERVE, analysis=None):
  """(Plan, SearchResult) of the fastest plan for a training-step GraphDef on
  `devices` devices of `cluster` (preset or spec file; default cpu-host) with
  `device_memory` each (default: the cluster's), of which the plan leaves
  `memory_reserve` (a fraction, default 10%) free. calibration: a cost table
  (`tfsplit calibrate`) whose measured op times override the roofline."""
  check_devices(devices)
  profile = profile_graph(graph_def, devices, cluster, calibration, source, analysis)
  return plan_profile(profile, devices, device_memory, cluster, top, progress, max_tp,
                      graph=source, memory_reserve=memory_reserve)


def resolve(plan, graph_def, devices=None, device_memory=None, cluster=None,
            available=None, source="the graph", memory_reserve=DEFAULT_RESERVE):
  """The Plan to split `graph_def` with: plan='auto' searches one for
  `devices` (default: `available`) devices of `cluster` (default: one host
  of the cpu-host preset holding them all) that leaves `memory_reserve` of
  `device_memory` free; a path or a JSON dict is read; a Plan is taken as
  is. Checked against the graph's layers and against the `available`
  devices (when given)."""
  if isinstance(plan, str) and plan == AUTO:
    devices = available if devices is None else devices
    if devices is None:
      raise PlanError("plan='auto' needs devices=N (how many devices to plan for)")
    check_devices(devices)
    if available is not None and devices > available:
      raise PlanError(f"too few devices: planning for {devices} but {available} are "
                      "available")
    if cluster is None:
      cluster = local_cluster(devices)
    analysis = _analysis(graph_def)   # one layer detection: profile and bind
    found, _ = plan_graph(graph_def, devices, device_memory, cluster, source=None,
                          memory_reserve=memory_reserve, analysis=analysis)
    return found.bind(graph_def, analysis)
  from tfsplit.plan import plan as plan_lib  # pylint: disable=import-outside-toplevel
  if isinstance(plan, Plan):
    found = plan
  elif isinstance(plan, dict):
    found = plan_lib.from_json(plan)
  elif isinstance(plan, str):
    found = read(plan)
  else:
    raise PlanError(f"plan must be 'auto', a plan file or a Plan, got {type(plan).__name__}")
  if devices is not None and devices != found.devices:
    raise PlanError(f"the plan is for {found.devices} devices but devices={devices}; make a "
                    f"plan for {devices} devices")
  if available is not None:
    found.check_devices(available)
  analysis = _analysis(graph_def)   # one layer detection for both
  found.check_graph(model_layer_names(graph_def, analysis), source)
  return found.bind(graph_def, analysis)


def model_layer_names(graph_def, analysis=None):
  """Names of the graph's layers with parameters (what plans cut);
  `analysis`: graph_def's Analysis, if the caller has one."""
  return [l.name for l in (analysis or _analysis(graph_def)).layers.model_layers]


def _analysis(graph_def):
  from tfsplit.passes.analysis import Analysis  # pylint: disable=import-outside-toplevel
  return Analysis(graph_def)
