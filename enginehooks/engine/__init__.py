"""The rollout side, engine-agnostic: the engine contract (verbs, method names, what an
engine supplies), the receiving state of one worker, expectations derived from the
engine, and `LocalEngine`, a torch module as a replica."""
