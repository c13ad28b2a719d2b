"""Update rules: what state a flat group keeps and how one step changes it (AdamW), and the math of the state's encodings (remainders, int8 maps)."""
