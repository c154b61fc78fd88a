"""kernelbay-spec-dflash2: the DFlash2 block drafter for speculative decoding.

The proposer ``dflash2`` drafts a whole block of tokens in one forward pass, conditioned on
hidden states of several target layers, and picks the block's path through each slot's top-c
candidates with an exact Viterbi search (or samples it). Importing this package imports no
torch; the model modules import it when used.
"""

__version__ = "0.1.0"
