"""The target that trains nothing, apart from the loss (which imports torch): the launcher packs rows with it."""

IGNORE_INDEX = -100  # targets equal to this contribute no loss and no gradient (as in F.cross_entropy)
