from .cli import run

if __name__ == "__main__":  # a spawned child process (the streaming loader's) imports this module too
    run()
