"""The jobs' configuration: typed sections (:mod:`.schema`), the checks of a whole config before
any work starts (:mod:`.checks`), the presets shipped with the package (:mod:`.presets`), the
shapes of a run built with random weights (:mod:`.model_shapes`) and ``cooper config``'s handler
(:mod:`.show`: a lookup needs the schema only)."""
