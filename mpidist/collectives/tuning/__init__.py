"""Measuring for algorithm="auto", apart from the calls it decides: the alpha-beta cost
model (costmodel), `mpidist tune` (tune), which times every algorithm at a ladder of
sizes and writes the decision table that collectives.select reads, and `mpidist explain`
(explain). This package uses the dispatch code (collectives.core, select); nothing there
imports it, so no probe or trial can run inside a user's call.
See docs/ARCHITECTURE.md (collectives)."""
