"""trainlab's cost model: pure functions (see the package modules)."""
