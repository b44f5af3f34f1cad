"""The cost model and what is built on it: `model` (the fitted per-step costs), `profile`
(measuring them on this host's engine) and `plan` (the P:D split and threads for a workload).
`serve`, `plan` and the simulator import it; it imports neither the router nor bench."""
