"""One module per `tfsplit` command (*_cmd.py); common.py says what each defines."""
