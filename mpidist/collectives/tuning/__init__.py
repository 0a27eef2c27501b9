"""Measuring for algorithm="auto", apart from the calls it decides: the timing harness
(timing), `mpidist tune` (tune), which times every algorithm at a ladder of sizes and
writes the decision table that collectives.select reads, and `mpidist explain` (explain),
which says per size which table row or rule decides. This package uses the dispatch code
(collectives.core, select); nothing there imports it, so no trial can run inside a user's
call.
See docs/ARCHITECTURE.md (collectives)."""
