"""`tfsplit.keras`: train a Keras model split over a device mesh with fit().

    model = build_model()                  # a keras.Model or a tf_keras.Model
    split_model = tfsplit.keras.split(model, mesh="dp=2,tp=2", microbatches=2)
    split_model.compile(optimizer="adam", loss=..., metrics=[...])
    split_model.fit(dataset, epochs=2, validation_data=val, callbacks=[...])
    split_model.save_weights("model.weights.h5")   # full weights, for the plain model

Keras 3 on TensorFlow has no model parallelism (its distribution API is
implemented for JAX only); here the Keras loop runs unchanged and each
training step is one tfsplit.split graph: tensor parallelism over `tp`,
data parallelism over `dp`, pipeline stages over `pp`, micro-batches, and
the memory passes, with the options tfsplit.split takes. Metrics, callbacks,
validation_data and steps_per_execution work as in plain fit; after fit,
evaluate and predict run split too, over the same shards (see
tfsplit/keras/model.py for where the weights live).
"""
from tfsplit.errors import PlanError

_CLASSES = {}


def _split_model_class(flavor):
  """SplitModel for the model's Keras: the mixin over keras.Model or tf_keras.Model."""
  from tfsplit.keras.model import SplitModelMixin  # pylint: disable=import-outside-toplevel
  base = flavor.module.Model
  if base not in _CLASSES:

    class SplitModel(SplitModelMixin, base):
      """A Keras model trained split over a mesh (tfsplit.keras.split)."""

      def __init__(self, model, flavor_, options, mesh_axes):
        super().__init__(name=f"split_{model.name}")
        self._init_split(model, flavor_, options, mesh_axes)

    _CLASSES[base] = SplitModel
  return _CLASSES[base]


def split(model, mesh=None, microbatches=1, strategy=None, distribution=None, **options):
  """A Keras model that trains `model` split over `mesh` with fit().

  model: a built or unbuilt keras.Model (Keras 3) or tf_keras.Model.
  mesh: 'tp=2', 'dp=2,tp=2', 'pp=2', ... on this process's logical devices
    (GPUs if any, else CPUs), or a cluster's tasks with cluster=; default
    'dp=2', or the distribution's.
  strategy: 'megatron' (default without a distribution) or 'none'.
  distribution: a keras.distribution.ModelParallel or DataParallel (default:
    the one keras.distribution.set_distribution set, when no mesh is given):
    its device mesh is the mesh, its layout map the variables' shardings
    (tfsplit/runtime/keras_distribution.py says what maps to what).
  microbatches: each replica's batch is cut into this many micro-batches
    (gradients accumulated in the graph; with 'pp', the pipeline's).
  options: the other keyword arguments of tfsplit.split (schedule,
    layer_ranges, virtual_stages, recompute, zero, offload, bucket_bytes,
    timeout_seconds, cluster, annotations, weights: a model.save_weights
    .weights.h5 or a TF checkpoint the first split starts from, each shard
    read as its slice), and plan="auto" (with devices=
    and device_memory=) or plan="plan.json" instead of mesh: the planner
    chooses the mesh, micro-batches, schedule and memory passes from the
    training step traced at the first batch.

  Compile the returned model (not `model`) and call fit / evaluate / predict
  on it; its save_weights and save write the wrapped model's full weights.
  Every batch must divide by dp x microbatches; a batch of new shapes (a
  smaller last batch) is split once more over the same shards.
  """
  from tfsplit.keras.flavors import flavor_of  # pylint: disable=import-outside-toplevel
  from tfsplit.runtime import runners  # pylint: disable=import-outside-toplevel
  try:
    flavor = flavor_of(model)
  except TypeError as e:
    raise PlanError(str(e)) from None
  if distribution is None and mesh is None and options.get("plan") is None:
    from tfsplit.runtime.keras_distribution import global_distribution  # pylint: disable=import-outside-toplevel
    distribution = global_distribution()
  if distribution is not None:
    if flavor.name != "Keras 3":
      raise PlanError("distribution= is Keras 3's keras.distribution API; this is a tf_keras "
                      "model: give mesh= and annotations= instead")
    from tfsplit.runtime.split_function import distribution_options  # pylint: disable=import-outside-toplevel
    options = dict(options, strategy=strategy)
    mesh, _ = distribution_options(distribution, mesh, options.get("plan"), options)
    # Each split of the model reads the layout map, once its variables exist.
    options["distribution"] = distribution
    strategy = options["strategy"]
  options = dict(options, strategy=strategy or "megatron")
  if options.get("weights") is not None:
    # A .weights.h5 names its datasets by Keras's saving walk of the model.
    options["weights_model"] = model
  if options.get("plan") is not None:
    # The plan picks the mesh and micro-batches from the traced step, so
    # they are known after the first batch (model.py reads them then).
    return _split_model_class(flavor)(model, flavor, options, None)
  options.pop("plan", None)
  mesh = mesh or "dp=2"
  mesh_axes = dict(runners.choose(mesh, options.get("cluster")).place(mesh).axes)
  options = dict(options, mesh=mesh, microbatches=microbatches)
  return _split_model_class(flavor)(model, flavor, options, mesh_axes)

