"""One analysis of the graph, shared by every pass (Grappler's item + NodeMap).

The graph index, the variables, static shapes and the layer report are
computed once and kept until a pass changes the graph; `replace` installs the
changed GraphDef and drops what depended on the old one (shapes the pass
carried over are kept).
"""
from tfsplit.graph import Graph, find_variables, infer_shapes
from tfsplit.graph.layers import detect_layers


class Analysis(object):
  """graph (tfsplit Graph), variables, shapes and layers of one GraphDef."""

  def __init__(self, graph_def):
    self.replace(graph_def)

  def replace(self, graph_def, known_shapes=None):
    """`known_shapes`: what the pass that made `graph_def` knows of its
    shapes (see infer_shapes' `known`), so only the rest is inferred."""
    self.graph_def = graph_def
    self.graph = Graph(graph_def)
    self._variables = self._shapes = self._layers = None
    self._known_shapes = known_shapes
    return self

  @property
  def variables(self):
    if self._variables is None:
      self._variables = find_variables(self.graph)
    return self._variables

  @property
  def shapes(self):
    if self._shapes is None:
      self._shapes = infer_shapes(self.graph, self.variables, known=self._known_shapes)
      self._known_shapes = None
    return self._shapes

  @property
  def layers(self):
    """The LayerReport (roles, layers, which layer owns each variable)."""
    if self._layers is None:
      self._layers = detect_layers(self.graph, self.shapes, self.variables)
    return self._layers

  @property
  def roles(self):
    return self.layers.role

  @property
  def variable_free(self):
    """Nodes whose values depend on no variable (see LayerReport)."""
    return self.layers.variable_free
