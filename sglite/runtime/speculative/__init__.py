"""Speculative decoding: n-gram and draft-model drafts, exact verification in the mixed step."""
from .block import verify_block
from .decoder import SpecDecoder, make_spec_decoder
from .ngram import NgramIndex
from .state import SpecState
from .verify import Draws, target_probs, verify_chain

__all__ = ["SpecDecoder", "make_spec_decoder", "NgramIndex", "SpecState", "target_probs", "verify_chain",
           "verify_block", "Draws"]
