/* checks.h: the unit checks ringleader-c-check runs (`ringleader-c-check unit`). */
#ifndef RINGLEADER_CHECKS_H
#define RINGLEADER_CHECKS_H

/* The batch frame decoder on hand-made frames: one JSON line per check; returns the failures. */
int run_batch_checks(void);

#endif /* RINGLEADER_CHECKS_H */
