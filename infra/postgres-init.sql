-- run once by the postgres container (docker-compose.yml): MLflow's own database
CREATE DATABASE mlflow;
