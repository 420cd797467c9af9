"""What every `tfsplit` command shares: flag parsing, --help, usage errors,
the flags several commands define, and writing a report.

A command module (listed in tfsplit.cli.COMMANDS) defines

  USAGE             one line: "tfsplit verify ORIGINAL REWRITTEN [--steps N]"
  ARGS              (fewest, most) positional arguments; most None: no limit
  REQUIRED          optional: flags that must be given, e.g. ("output",)
  ALIASES           optional: {old flag name: flag name}, accepted but not shown
  define_flags(fv)  its flags, on a fresh absl FlagValues, with dashed names
  run(fv, args)     the work; returns the exit code

and its docstring, which `tfsplit CMD --help` prints under the usage line,
followed by the flags. Flag names are dashed (--collective-timeout); the old
underscore spellings (--collective_timeout) are accepted as hidden aliases.
"""
import json
import os
import sys

from absl import flags

from tfsplit.errors import TfsplitError, printable

HELP_ARGS = frozenset(["-h", "-help", "--help", "--helpshort", "--helpfull"])


def quiet_tensorflow():
  """Imports TensorFlow with its C++ start-up chatter sent to /dev/null.

  TF prints several lines on stderr when it loads (oneDNN, CUDA stubs), even
  with TF_CPP_MIN_LOG_LEVEL set; they would bury our one-line messages.
  """
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  if os.environ.get("TFSPLIT_VERBOSE_TF"):
    return
  sys.stderr.flush()
  saved = os.dup(2)
  devnull = os.open(os.devnull, os.O_WRONLY)
  try:
    os.dup2(devnull, 2)
    import tensorflow  # pylint: disable=import-outside-toplevel
    # Listing devices probes CUDA, which logs an error on machines without it.
    tensorflow.config.list_physical_devices()
  except ImportError:
    pass  # reported below, with stderr back, when a command needs it
  finally:
    os.dup2(saved, 2)
    os.close(saved)
    os.close(devnull)


def main(name, module, args):
  """Runs command `name` (its `module`) on the command line `args`."""
  fv = flags.FlagValues()
  module.define_flags(fv)
  args = list(args)
  options = args[:args.index("--")] if "--" in args else args
  if any(a in HELP_ARGS for a in options):
    sys.stdout.write(help_text(module, fv))
    return 0
  try:
    positional = fv([f"tfsplit {name}"] + dashed(fv, args, getattr(module, "ALIASES", {})))[1:]
  except flags.Error as e:
    raise TfsplitError(f"{printable(str(e))}; run 'tfsplit {name} --help' for the "
                       "flags") from None
  missing = [f"--{f}" for f in getattr(module, "REQUIRED", ()) if not fv[f].value]
  fewest, most = module.ARGS
  if missing or len(positional) < fewest:
    what = f"missing {', '.join(missing)}" if missing else "missing argument(s)"
    raise TfsplitError(f"{what}; usage: {module.USAGE}")
  if most is not None and len(positional) > most:
    raise TfsplitError(f"unexpected argument(s) {' '.join(positional[most:])}; "
                       f"usage: {module.USAGE}")
  return module.run(fv, positional)


def help_text(module, fv):
  """Usage line, the module's docstring and every flag with its help."""
  text = fv.get_help(prefix="", include_special_flags=False)
  flag_lines = [l for l in text.splitlines() if l.startswith(" ")]  # not module headers
  return (f"usage: {module.USAGE}\n\n{module.__doc__.strip()}\n\nflags:\n" +
          "\n".join(flag_lines) + "\n")


def dashed(fv, args, aliases=None):
  """`args` with old flag spellings (--int_max, aliases) as defined (--int-max)."""
  out = []
  for i, arg in enumerate(args):
    if arg == "--":
      return out + args[i:]
    dashes = len(arg) - len(arg.lstrip("-"))
    name, eq, value = arg[dashes:].partition("=")
    if dashes in (1, 2) and name and name not in fv:
      new = (aliases or {}).get(name, name.replace("_", "-"))
      if new in fv or (new.startswith("no") and new[2:] in fv):
        arg = "-" * dashes + new + eq + value
    out.append(arg)
  return out


def values(fv, *names):
  """{name with underscores: value} of the flags `names`, as keyword arguments."""
  return {name.replace("-", "_"): fv[name].value for name in names}


# --- flags several commands define -------------------------------------------------
def define_output(fv, what):
  flags.DEFINE_string("output", None, what, short_name="o", flag_values=fv)


def define_format(fv):
  flags.DEFINE_enum("format", "table", ["table", "json"], "Output format.", flag_values=fv)


def define_source(fv, graph="GRAPH", variables=True):
  """--signature (and --variables) of a graph argument given as a file."""
  flags.DEFINE_string("signature", None, f"SavedModel signature of {graph} to load.",
                      flag_values=fv)
  if variables:
    flags.DEFINE_string(
        "variables", None, f"Checkpoint prefix or SavedModel directory to take the "
        f"shapes and names of {graph}'s variables from, when {graph} was written "
        "without them (tf.io.write_graph of a function's graph).", flag_values=fv)


# --- output ------------------------------------------------------------------------
def emit(text, output=None):
  """Writes a command's report to `output` (atomically) or to stdout."""
  if output:
    from tfsplit.fileio import write_atomically  # pylint: disable=import-outside-toplevel
    write_atomically(output, text)
  else:
    sys.stdout.write(text)


def emit_report(fmt, data, lines, output=None):
  """`data` as JSON when fmt is 'json', else the text `lines`."""
  emit(json.dumps(data, indent=2) + "\n" if fmt == "json" else "\n".join(lines) + "\n",
       output)
