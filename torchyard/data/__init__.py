"""Reading a registered dataset inside the ranks: the built-in workloads read it with this, and a
script with the tiny helper :func:`loader`::

    from torchyard import data

    batches = data.loader(batch_size=32)         # the run spec's data.dataset, this rank's share
    if saved:                                    # your checkpoint: batches.state_dict() at its step
        batches.load_state_dict(saved["data"])
    for epoch in range(epochs):
        for batch in batches:                    # one epoch, from where the state left off
            ...                                  # batch: a list of samples (dicts), or collate's
        save({"data": batches.state_dict(), ...})

Each sample is a dict of its fields, decoded by extension (``.npy`` → numpy array, ``.cls`` →
int, ``.txt`` → str, ``.json`` → object, ``.pt``/``.pth`` → torch.load(weights_only), else bytes)
plus ``__index__`` (its global number) and ``__shard__`` (the shard file it came from).

**The order is global.** Epoch ``e`` of seed ``s`` puts the samples in one order: the shards in a
random order, then each window of ``shuffle_buffer`` positions shuffled (both drawn from (s, e)
alone; ``shuffle_buffer`` 0: the stored order). Rank ``r`` of ``W`` takes positions ``r, r+W,
r+2W, ...``: each step the ranks together take the next ``batch × W`` positions, so every rank has
the same number of steps per epoch (``(samples − cursor) // (batch × W)``, known from the registry's
sample count, whatever the shards' sizes: uneven shards never hang DDP), and the few positions left
at an epoch's end are skipped that epoch. Every sample of an epoch is read at most once, by one rank
and one loader process; a rank reads only its own samples, one seek per field into the shard (the
shard's index says where; every field's CRC-32 is checked: a corrupted shard fails the run naming
it). From an object store, a batch's samples are fetched together first (``torchyard/shardfiles.py``).

**A bad shard** (missing, truncated, failing a checksum) fails the run naming it, or, with
``on_bad_shard="skip"``, is skipped and counted: a shard found missing or of the wrong size at the
start by any rank is left out of the epoch's order on every rank (they agree on it: building the
loader is then a collective, on every rank); a sample found unreadable while reading is left out
of its batch and the batch's readable samples repeated in its place (the batch keeps its size,
every rank every step). ``Loader.bad`` says which shards were found bad (``left_out``: those left
out of the order), ``bad_samples`` how many samples this rank could not read. A resume with other shards left out than the saved position's
is refused: the order would be another.

**The data position is global too**: (epoch, cursor), the cursor being how many positions of the
epoch's order the ranks together have consumed. Saved with a checkpoint, it resumes the epoch with
the next unseen sample on any world size: the same order, a new stride.

Loader processes (``workers``) read and decode ahead (torch's DataLoader, ``prefetch_factor``
batches each); the rank's own process only computes which samples come next."""

from torchyard.data.loading import DATASET_DIR_ENV, Loader, loader
from torchyard.data.order import Order, Position, rank_positions, steps_left
from torchyard.data.shards import Sample, ShardError, ShardReader, decode_field

__all__ = [
    "DATASET_DIR_ENV",
    "Loader",
    "Order",
    "Position",
    "Sample",
    "ShardError",
    "ShardReader",
    "decode_field",
    "loader",
    "rank_positions",
    "steps_left",
]
