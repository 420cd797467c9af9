"""Where a node lives: on every device, or on its pipeline stage's devices."""
from tfsplit import constants


class Placement(object):
  """Devices of each node under an optional chunk assignment (node -> chunk).

  With pipeline stages each node lives only on the devices whose 'pp'
  coordinate is its stage; TF sends tensors between stages. Model chunk c
  (the layers cut into S * v contiguous chunks, v >= 1 per stage) runs on
  stage c % S, so with one chunk per stage chunk and stage agree.
  """

  def __init__(self, mesh, stage_of=None, only=None):
    """only: the device ids to materialize (one task's), None for all."""
    self.mesh = mesh
    self.only = None if only is None else frozenset(only)
    self.pp = constants.PIPELINE_AXIS if stage_of is not None else None
    self.stage_of = stage_of or {}
    self.stages = mesh.axes.get(constants.PIPELINE_AXIS, 1)
    self._by_stage = {}
    self._counterparts = {}

  def stage(self, name):
    return self.stage_of.get(name, 0) % self.stages if self.pp else None

  def on_stage(self, d, stage):
    """Device d's counterpart on `stage` (same other coordinates)."""
    if self.pp is None or stage is None:
      return d
    return self.stage_map(stage)[d]

  def stage_map(self, stage):
    """Every device's counterpart on `stage`, found once per stage (asked
    for each device of each tensor, on a mesh as large as a cluster)."""
    found = self._counterparts.get(stage)
    if found is None:
      found = [d if self.mesh.coord(d, self.pp) == stage else
               self.mesh.device_id({**self.mesh.coords(d), self.pp: stage})
               for d in range(self.mesh.size)]
      self._counterparts[stage] = found
    return found

  def all_ids_for(self, name):
    """Devices holding a copy of node `name`, on every task (a tuple: shared)."""
    return self._ids(self.stage(name))[0]

  def ids_for(self, name):
    """Devices holding a copy of node `name` that are materialized."""
    return self._ids(self.stage(name))[1]

  def _ids(self, stage):
    """(every device of `stage`, the materialized ones): found once per
    stage, the mesh being as large as a cluster."""
    found = self._by_stage.get(stage)
    if found is None:
      every = tuple(d for d in range(self.mesh.size)
                    if stage is None or self.mesh.coord(d, self.pp) == stage)
      found = (every, every if self.only is None else tuple(d for d in every if d in self.only))
      self._by_stage[stage] = found
    return found
