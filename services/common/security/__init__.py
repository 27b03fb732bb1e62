"""Who may call what, and the secrets that prove it: identities, certificates, TLS, admin tokens."""
