"""`python -m fuser ...` runs the command line."""

from fuser.cli import program

program()
