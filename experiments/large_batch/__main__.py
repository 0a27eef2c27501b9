"""`python -m experiments.large_batch [--quick]`: see the package docstring."""
from experiments.large_batch.driver import main

raise SystemExit(main())
