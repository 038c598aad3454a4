"""The `perseus` command line."""
