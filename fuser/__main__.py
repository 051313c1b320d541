"""`python -m fuser ...` runs the command line."""

from fuser.cli import main

main()
