"""GraphDef IR: loading and saving, the indexed Graph, shapes, variables, layers."""
from tfsplit.graph.io import load_graph, save_graph, validate_graph_def
from tfsplit.graph.ir import Graph, parse_input, tensor_name
from tfsplit.graph.shapes import ShapeMap, TensorInfo, infer_shapes
from tfsplit.graph.variables import VariableInfo, find_variables
