"""The jobs besides Cooper RL: SFT of a policy (the demo's first stage), VerifyRM training and
evaluation, held-out evaluation of a policy, and hybrid-label annotation of reward-model data
(the rule verifier and an LLM judge must agree). Only the CLI and the demo import this package."""
