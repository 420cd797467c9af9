"""The ExampleModel record and the size table shared by every example.

Kept free of TensorFlow imports so that listing names and sizes is cheap.
"""
import dataclasses
from typing import Any, Callable, List

from tfsplit.errors import TfsplitError

KINDS = ("forward", "train")


@dataclasses.dataclass(frozen=True)
class MlpConfig:
  """A stack of Dense layers; the last one has no activation."""
  in_dim: int
  width: int
  classes: int
  layers: int
  batch: int
  lr: float = 1e-3


@dataclasses.dataclass(frozen=True)
class GptConfig:
  """A pre-LayerNorm decoder-only transformer (GPT-2 layout, no dropout)."""
  vocab: int
  seq: int
  hidden: int
  heads: int
  blocks: int
  batch: int
  lr: float = 1e-3
  eps: float = 1e-5

  @property
  def head_dim(self):
    return self.hidden // self.heads

  @property
  def mlp_dim(self):
    return 4 * self.hidden


# Every dimension is a multiple of 8 so tests can split any of them 2, 4 or 8
# ways. `large` only needs to trace (benchmarks of graph passes), not train.
CONFIGS = {
    "mlp": {
        "tiny": MlpConfig(in_dim=32, width=32, classes=16, layers=3, batch=4),
        "small": MlpConfig(in_dim=64, width=128, classes=32, layers=4, batch=16),
        "large": MlpConfig(in_dim=256, width=512, classes=64, layers=48,
                           batch=32),
    },
    "gpt": {
        "tiny": GptConfig(vocab=64, seq=8, hidden=32, heads=4, blocks=2,
                          batch=4),
        "small": GptConfig(vocab=256, seq=32, hidden=64, heads=4, blocks=4,
                           batch=8),
        "large": GptConfig(vocab=1024, seq=64, hidden=256, heads=8, blocks=48,
                           batch=8),
    },
}
SIZES = ("tiny", "small", "large")
FLAVORS = ("raw", "keras3", "tfkeras")
NAMES = tuple(f"{family}_{flavor}" for flavor in FLAVORS
              for family in ("mlp", "gpt"))
# The model corpus (corpus.py): Keras-only families, not in NAMES.
CORPUS_FAMILIES = ("causallm", "llama", "moe", "switch", "bert", "vit")
CORPUS_NAMES = tuple(f"{family}_{flavor}" for flavor in ("keras3", "tfkeras")
                     for family in CORPUS_FAMILIES)


def split_name(name):
  """'gpt_keras3' -> ('gpt', 'keras3'), with a helpful error otherwise."""
  family, _, flavor = name.partition("_")
  if name in CORPUS_NAMES:
    return family, flavor
  if family not in CONFIGS or flavor not in FLAVORS:
    raise TfsplitError(f"unknown example model '{name}'; choose one of "
                       f"{', '.join(NAMES + CORPUS_NAMES)}")
  return family, flavor


def config_for(family, size, batch_size=None, configs=None, what="", overrides=None):
  """configs[family][size] (default: this zoo's), with batch_size and the
  fields of `overrides` if given; `what` names the model in the error for an
  unknown size."""
  configs = CONFIGS if configs is None else configs
  if size not in configs[family]:
    raise TfsplitError(f"unknown model size '{size}'{what}; choose one of "
                       f"{', '.join(configs[family])}")
  cfg = configs[family][size]
  if batch_size is not None:
    if batch_size < 1:
      raise TfsplitError(f"batch_size must be positive, got {batch_size}")
    cfg = dataclasses.replace(cfg, batch=int(batch_size))
  if overrides:
    cfg = dataclasses.replace(cfg, **overrides)
  return cfg


@dataclasses.dataclass
class ExampleModel:
  """One example: its variables, optimizer and traced-ready tf.functions.

  `forward` maps inputs to logits; `train_step` maps inputs and labels to the
  loss and applies one Adam update. Both carry an input signature with a
  static batch size, so `concrete(kind)` gives a fully static graph.
  """
  name: str
  size: str
  config: Any
  variables: List[Any]
  optimizer: Any
  forward: Any
  train_step: Any
  forward_signature: List[Any]
  train_signature: List[Any]
  # The Keras model object (None for raw models); kept so it stays alive.
  model: Any = None
  # Unique scoped names parallel to `variables` (Keras 3 gives its inner
  # tf.Variables non-unique names like 'gpt/kernel:0'; these use its paths).
  variable_paths: List[str] = dataclasses.field(default_factory=list)
  input_fn: Callable = dataclasses.field(default=None, repr=False)
  # -> [(path, tf.Variable)] of the optimizer, read lazily.
  optimizer_variables_fn: Callable = dataclasses.field(default=None,
                                                       repr=False)

  def make_inputs(self, kind="train", seed=0):
    """Seeded numpy inputs matching `<kind>_signature`."""
    _check_kind(kind)
    return self.input_fn(kind, seed)

  def all_variables(self):
    """Model variables followed by the optimizer's (step, lr, Adam slots)."""
    return [v for _, v in self._all_named()]

  def variable_names(self):
    """Unique scoped names parallel to all_variables(), without ':0'."""
    return [name for name, _ in self._all_named()]

  def _all_named(self):
    out = list(zip(self.variable_paths, self.variables))
    seen = {id(v) for v in self.variables}
    for name, v in self.optimizer_variables_fn():
      if id(v) not in seen:
        seen.add(id(v))
        out.append((name, v))
    return out

  def signature(self, kind):
    _check_kind(kind)
    return self.forward_signature if kind == "forward" else self.train_signature

  def function(self, kind):
    _check_kind(kind)
    return self.forward if kind == "forward" else self.train_step

  def concrete(self, kind):
    """The ConcreteFunction of `kind` ('forward' or 'train')."""
    return self.function(kind).get_concrete_function()


def _check_kind(kind):
  if kind not in KINDS:
    raise TfsplitError(f"unknown function kind '{kind}'; choose one of "
                       f"{', '.join(KINDS)}")
