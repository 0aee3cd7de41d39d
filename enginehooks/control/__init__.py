"""The control plane, trainer side: `WeightSync` (the coordinator), engine handles, and
the report a push returns."""
