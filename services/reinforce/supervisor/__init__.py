"""The local supervisor (`reinforce run`): a run's services as child processes on this machine, and the commands that
read a run folder (`reinforce status`, `reinforce samples`)."""
