"""The jobs' configuration: typed sections (:mod:`.schema`), the checks of a whole config before
any work starts (:mod:`.checks`) and the presets shipped with the package (:mod:`.presets`)."""
