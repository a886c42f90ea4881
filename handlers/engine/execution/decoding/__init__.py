"""The next token: sampling, grammars and checking speculative guesses."""
