"""Communication between ranks: transports (threads, processes, same-host links), wire, failures."""
