"""One module per `tfsplit` command; each exposes main(argv) -> exit code."""
