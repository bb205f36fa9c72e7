"""The `megapo <command>` entry points (megapo/cli.py lists them), one module each: argument parsing, input
checks that name the flag, and the call into the library package that owns the feature. Library packages
never import from here."""
