"""The `tpplan` command line: app.py (the typer app, --debug, main), commands.py
(the list of commands), one module per command, output.py (how results print
and which exit code they give). Flag names appear only here."""
