"""The null model (`--model null`): no weights and no arithmetic, to measure the runtime itself."""
