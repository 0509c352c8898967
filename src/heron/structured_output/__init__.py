"""Grammar-constrained decoding (JSON schema, regex, choice, EBNF) through
xgrammar: compiled off the step loop, applied as a bitmask to the logits."""
