"""The fixed text set for perplexity (quantized against float32 weights).

Eight short passages: four in the style of Python's documentation (what the demo
model was trained on) and four of plain English prose. Changing them changes every
recorded perplexity figure, so leave them as they are.
"""

PERPLEXITY_TEXTS = (
    "Return a new list containing all items from the iterable in ascending order. "
    "A custom key function can be supplied to customize the sort order, and the "
    "reverse flag can be set to request the result in descending order.",
    "This module provides a portable way of using operating system dependent "
    "functionality. If you just want to read or write a file see open(), if you "
    "want to manipulate paths, see the os.path module.",
    "Raised when an operation or function is applied to an object of inappropriate "
    "type. The associated value is a string giving details about the type mismatch.",
    "Open the file and return a stream. The mode argument is an optional string that "
    "specifies the mode in which the file is opened. It defaults to 'r' which means "
    "open for reading in text mode.",
    "The river ran fast after the spring rain, and the old bridge shook whenever a "
    "cart went over it. The children watched from the bank and counted the logs that "
    "floated past on their way to the sea.",
    "A good recipe for bread needs only flour, water, salt and yeast. The dough is "
    "kneaded until it is smooth, left to rise for an hour, shaped into a loaf and "
    "baked in a hot oven until the crust is brown.",
    "The committee met on Tuesday to discuss the budget for the coming year. Most "
    "members agreed that the library should receive more money, but no one could "
    "agree on where the savings would come from.",
    "Light from the sun takes about eight minutes to reach the Earth. The light we "
    "see from distant stars left them long ago, so looking at the night sky is a way "
    "of looking into the past.",
)


def perplexity(engine, texts=PERPLEXITY_TEXTS, bucket: int = 64) -> float:
    """exp(mean token NLL) of a decoder engine over `texts`, each cut to `bucket` tokens."""
    import jax
    import numpy as np

    from engine.decoder.model import token_nll

    nll = jax.jit(lambda p, t: token_nll(p, engine.cfg, t))
    total, count = 0.0, 0
    for text in texts:
        ids = engine.tokenizer.encode(text)[:bucket]
        padded = np.zeros(bucket, np.int32)
        padded[: len(ids)] = ids
        terms = np.asarray(nll(engine.params, padded))[: len(ids) - 1]
        total, count = total + float(terms.sum()), count + len(terms)
    return float(np.exp(total / count))
