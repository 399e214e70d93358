"""The reward model's negatives: verified-wrong solutions, and the preference pairs built from them.

* :mod:`~cooper_mcore.negatives.pairs`: the generators drawn from the step's rollouts, the factory
  that picks a generator by ``rm.negatives``, and the pairs (a rule-correct positive, a
  verified-wrong negative) of the reward model's update.
* :mod:`~cooper_mcore.negatives.assistant`: Cooper's assistant LLM, which rewrites a correct
  solution into a convincing wrong one.
* :mod:`~cooper_mcore.negatives.rewrites`: programmatic wrong rewrites (no LLM needed).
* :mod:`~cooper_mcore.negatives.protocols`: the interfaces the generators are written against.

Every negative is checked by a verifier (:mod:`cooper_mcore.verify`); the assistant is reached
through a chat client such as :class:`cooper_mcore.llm_client.OpenAIChatClient`.
"""
