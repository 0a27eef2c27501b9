"""`python -m experiments.compression [--quick]`: see the package docstring."""
from experiments.compression.driver import main

raise SystemExit(main())
