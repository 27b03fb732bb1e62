"""The Router: stateless OpenAI-compatible HTTP front that places requests with the Conductor
and relays the engines' answers (see `app`)."""
