"""Memory of a (rewritten) GraphDef per device: states kept between steps.

What lives on a device for the whole step, from the graph and its placement
(each node's device, mapped to a device index):

  parameters        trainable variables placed there
  optimizer state   the other variables (Adam moments, step counter, ...)
  constants         Const tensors (TF allocates them once, with the kernel)
  inputs            the step's fed inputs

Gradients and activations are transient: they are allocated when produced
and freed after their last reader, so their peak depends on the schedule;
tfsplit.cost.graph_sim simulates it and reports the per-device peak, which
DeviceMemory carries beside the static part. `gradients` here is the size of
the gradients the device's parameters receive, for the breakdown only (it is
already inside the simulated transient peak).

TF's BFC allocator rounds every allocation up to 256 bytes; the estimate does
the same (GRANULARITY), which matters for graphs with many small tensors.
"""
import dataclasses

GRANULARITY = 256


def round_up(nbytes, granularity=GRANULARITY):
  if nbytes <= 0:
    return 0
  return -(-int(nbytes) // granularity) * granularity


@dataclasses.dataclass
class DeviceMemory:
  """One device's memory: static states, and the simulated peak."""
  device: str
  parameters: int = 0
  optimizer_state: int = 0
  constants: int = 0
  inputs: int = 0
  gradients: int = 0          # inside `transient_peak`; for the breakdown
  transient_peak: int = 0     # activations + gradients + temporaries, peak
  peak: int = 0               # static + transient at the simulated peak

  @property
  def static(self):
    return self.parameters + self.optimizer_state + self.constants + \
        self.inputs

  def as_dict(self):
    d = dataclasses.asdict(self)
    d["static"] = self.static
    return d


def static_memory(graph, shapes, variables, device_of, device_names,
                  granularity=GRANULARITY, skip=()):
  """[DeviceMemory] with the static part filled in, one per device.

  graph: a tfsplit Graph; shapes: its ShapeMap; variables: its VariableInfo
  list; device_of: node name -> device index; device_names: index -> name;
  skip: constants and inputs not to count (nodes TF prunes from the step).
  """
  rows = [DeviceMemory(name) for name in device_names]
  for var in variables:
    row = rows[device_of.get(var.node, 0)]
    nbytes = round_up(var.num_bytes or 0, granularity)
    if var.trainable is False:
      row.optimizer_state += nbytes
    else:
      row.parameters += nbytes
      row.gradients += nbytes
  from tfsplit.graph import variables as variables_lib  # pylint: disable=import-outside-toplevel
  for node in graph.nodes:
    if node.op not in ("Const", "Placeholder") or \
        variables_lib.is_variable_node(node) or node.name in skip:
      continue
    outs = shapes[node.name] if node.name in shapes else []
    nbytes = sum(round_up(i.num_bytes or 0, granularity) for i in outs)
    row = rows[device_of.get(node.name, 0)]
    if node.op == "Const":
      row.constants += nbytes
    else:
      row.inputs += nbytes
  return rows
