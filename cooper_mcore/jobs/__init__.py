"""The jobs besides Cooper RL: SFT of a policy (the demo's first stage), VerifyRM training and
evaluation, and held-out evaluation of a policy. Only the CLI and the demo import this package."""
