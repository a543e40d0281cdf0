"""memo.planner: trace parsing, DSA planning (heuristic, MIP, bi-level), plan files, alpha LP."""
