"""Configuration: one pydantic section per stage (``stages.py``, ``rl.py``, ``model.py``,
``data.py``) and the typed settings each concern reads (``settings.py``, ``loss.py``)."""
