"""Train DFlash and DSpark drafts for any Hugging Face causal LM target.

Pipeline: `data` (the target writes prompts and answers them) -> `features` (its hidden states, cached) ->
`vocab` (pruned draft vocabulary) -> `trainer` (block training with accelerate). `train_draft` runs all of it.
"""
